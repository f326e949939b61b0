#include "planner/planner.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/internal/planner_internal.h"

namespace packd {

using namespace planner_internal;  // NOLINT: this file defines them

namespace {

// Token sums the planner accepts: the loss is divided by global_loss_tokens,
// a double in every trainer, exact up to 2^53.
constexpr int64_t kMaxTotalTokens = int64_t{1} << 53;

}  // namespace

namespace planner_internal {

absl::StatusOr<Checked> Validate(absl::Span<const int64_t> lengths,
                                 absl::Span<const int64_t> loss_tokens,
                                 const PlanOptions& options) {
  Checked c;
  if (options.max_tokens_per_micro_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens_per_micro_batch must be positive, not ",
                     options.max_tokens_per_micro_batch));
  }
  if (options.num_ranks < 0 || options.micro_batch_multiple < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_ranks (", options.num_ranks, ") and micro_batch_multiple (",
        options.micro_batch_multiple, ") must not be negative"));
  }
  c.budget = options.max_tokens_per_micro_batch;
  c.ranks = std::max<int32_t>(1, options.num_ranks);
  c.multiple = std::max<int32_t>(1, options.micro_batch_multiple);
  if (!loss_tokens.empty() && loss_tokens.size() != lengths.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_tokens has ", loss_tokens.size(), " entries but lengths has ",
        lengths.size(), ": give one per sample, or none"));
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "] is ", lengths[i], ", below 0"));
    }
    if (!loss_tokens.empty() &&
        (loss_tokens[i] < 0 || loss_tokens[i] > lengths[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loss_tokens[", i, "] is ", loss_tokens[i],
          "; it must be in [0, lengths[", i, "] = ", lengths[i], "]"));
    }
    if (__builtin_add_overflow(c.total, lengths[i], &c.total) ||
        c.total > kMaxTotalTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("the sum of lengths passes 2^53 (", kMaxTotalTokens,
                       ") tokens at lengths[", i,
                       "]: global_loss_tokens would not be exact as a double"));
    }
    c.capped_total += std::min(lengths[i], c.budget);
  }
  // A budget above the total fits every sample, as the total does: plan with
  // the smaller, so sums of fills and budgets stay far from int64's limit.
  c.budget = std::min(c.budget, std::max<int64_t>(1, c.total));
  return c;
}

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace planner_internal

namespace {

// Above this many samples, Karmarkar-Karp's cost (every partial solution
// holds a set per rank) is not worth it: the greedy packing balances many
// samples to within a few tokens.
constexpr int64_t kBalancedPackingMaxSamples = 16384;

int64_t LowerBound(const Checked& c) {
  int64_t capacity;
  // Capacity past int64 holds any capped total (at most 2^53): one suffices.
  const int64_t bound =
      __builtin_mul_overflow(int64_t{c.ranks}, c.budget, &capacity)
          ? 1
          : c.capped_total / capacity + (c.capped_total % capacity != 0);
  return RoundUp(std::max<int64_t>(1, bound), c.multiple);
}

}  // namespace

namespace planner_internal {

Plan Assemble(Bins bins, absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> loss_tokens) {
  Plan plan;
  plan.micro_batches_per_rank = bins.empty() ? 0 : bins[0].size();
  int64_t max_rank = 0, total = 0;
  for (size_t r = 0; r < bins.size(); ++r) {
    int64_t rank_tokens = 0;
    for (std::vector<int64_t>& samples : bins[r]) {
      MicroBatch mb;
      mb.rank = static_cast<int32_t>(r);
      std::sort(samples.begin(), samples.end());
      for (int64_t i : samples) {
        mb.tokens += lengths[i];
        mb.loss_tokens += loss_tokens.empty() ? lengths[i] : loss_tokens[i];
      }
      mb.samples = std::move(samples);
      rank_tokens += mb.tokens;
      plan.global_loss_tokens += mb.loss_tokens;
      plan.micro_batches.push_back(std::move(mb));
    }
    max_rank = std::max(max_rank, rank_tokens);
    total += rank_tokens;
  }
  plan.imbalance =
      total == 0 ? 1.0 : static_cast<double>(max_rank) * bins.size() / total;
  return plan;
}

}  // namespace planner_internal

namespace {

// Samples by length, longest first (ties by index, for determinism).
std::vector<int64_t> LongestFirst(absl::Span<const int64_t> lengths) {
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[a] > lengths[b];
  });
  return order;
}

// One packing attempt with `m` micro-batches per rank: longest samples first,
// each to the rank with the fewest tokens that has room, into that rank's
// fullest micro-batch it fits (a sample over the budget: an empty one).
// False when some sample fits nowhere.
bool TryPack(absl::Span<const int64_t> lengths,
             const std::vector<int64_t>& order, const Checked& c, int64_t m,
             Bins* bins) {
  bins->assign(c.ranks, std::vector<std::vector<int64_t>>(m));
  std::vector<std::vector<int64_t>> fill(c.ranks, std::vector<int64_t>(m, 0));
  std::set<std::pair<int64_t, int32_t>> by_tokens;  // (rank tokens, rank)
  for (int32_t r = 0; r < c.ranks; ++r) by_tokens.insert({0, r});
  for (int64_t i : order) {
    const int64_t len = lengths[i];
    bool placed = false;
    for (auto it = by_tokens.begin(); it != by_tokens.end() && !placed; ++it) {
      const int32_t r = it->second;
      int64_t best = -1;
      for (int64_t b = 0; b < m; ++b) {
        const bool fits = len > c.budget ? (*bins)[r][b].empty()
                                         : fill[r][b] + len <= c.budget;
        if (fits && (best < 0 || fill[r][b] > fill[r][best])) best = b;
      }
      if (best < 0) continue;
      const int64_t tokens = it->first;
      by_tokens.erase(it);
      by_tokens.insert({tokens + len, r});
      (*bins)[r][best].push_back(i);
      fill[r][best] += len;
      placed = true;
    }
    if (!placed) return false;
  }
  return true;
}

// Fills empty micro-batches while others hold several samples: first from the
// same rank (rank tokens unchanged), then from any rank. A moved sample is a
// sample of a micro-batch of several, so it is within the budget.
void FillEmpty(absl::Span<const int64_t> lengths, Bins* bins) {
  auto move_smallest = [&](std::vector<int64_t>* from,
                           std::vector<int64_t>* to) {
    auto smallest = std::min_element(
        from->begin(), from->end(),
        [&](int64_t a, int64_t b) { return lengths[a] < lengths[b]; });
    to->push_back(*smallest);
    from->erase(smallest);
  };
  // Donors (micro-batches of two or more samples), largest first, gathered
  // once: a plan may hold many empty micro-batches and few donors, so looking
  // for a donor per empty micro-batch would be quadratic.
  auto donors_of = [](std::vector<std::vector<int64_t>>& rank,
                      std::vector<std::vector<int64_t>*>* donors) {
    for (std::vector<int64_t>& b : rank) {
      if (b.size() >= 2) donors->push_back(&b);
    }
  };
  auto fill = [&](std::vector<std::vector<int64_t>>& rank,
                  std::vector<std::vector<int64_t>*>& donors, size_t& next) {
    for (std::vector<int64_t>& b : rank) {
      if (!b.empty()) continue;
      while (next < donors.size() && donors[next]->size() < 2) ++next;
      if (next == donors.size()) return;
      move_smallest(donors[next], &b);
    }
  };
  for (auto& rank : *bins) {
    std::vector<std::vector<int64_t>*> donors;
    donors_of(rank, &donors);
    std::stable_sort(
        donors.begin(), donors.end(),
        [](const auto* a, const auto* b) { return a->size() > b->size(); });
    size_t next = 0;
    fill(rank, donors, next);
  }
  std::vector<std::vector<int64_t>*> donors;
  for (auto& rank : *bins) donors_of(rank, &donors);
  size_t next = 0;
  for (auto& rank : *bins) fill(rank, donors, next);
}

// Evens out rank tokens after packing: repeatedly moves a sample from the
// heaviest rank into a micro-batch of the lightest that has room, or swaps a
// sample of each, whichever narrows their gap the most, keeping every
// micro-batch within the budget and none emptied. Stops when nothing narrows
// the gap, or after `rounds`.
void Refine(absl::Span<const int64_t> lengths, const Checked& c, int rounds,
            Bins* bins) {
  const int64_t ranks = static_cast<int64_t>(bins->size());
  if (ranks < 2) return;
  auto fill_of = [&](const std::vector<int64_t>& b) {
    int64_t f = 0;
    for (int64_t i : b) f += lengths[i];
    return f;
  };
  std::vector<std::vector<int64_t>> fill(ranks);
  std::vector<int64_t> tokens(ranks, 0);
  for (int64_t r = 0; r < ranks; ++r) {
    for (const auto& b : (*bins)[r]) {
      fill[r].push_back(fill_of(b));
      tokens[r] += fill[r].back();
    }
  }
  for (int round = 0; round < rounds; ++round) {
    const int64_t h =
        std::max_element(tokens.begin(), tokens.end()) - tokens.begin();
    const int64_t l =
        std::min_element(tokens.begin(), tokens.end()) - tokens.begin();
    const int64_t gap = tokens[h] - tokens[l];
    if (gap <= 0) return;
    // The best change d (tokens moved from h to l) has 0 < d < gap and d
    // closest to gap / 2: the new gap is |gap - 2d|.
    int64_t best_d = 0, best_hb = -1, best_hi = -1, best_lb = -1, best_li = -1;
    auto consider = [&](int64_t d, int64_t hb, int64_t hi, int64_t lb,
                        int64_t li) {
      if (d <= 0 || d >= gap) return;
      if (best_hb < 0 ||
          std::llabs(gap - 2 * d) < std::llabs(gap - 2 * best_d)) {
        best_d = d, best_hb = hb, best_hi = hi, best_lb = lb, best_li = li;
      }
    };
    auto& hbins = (*bins)[h];
    auto& lbins = (*bins)[l];
    for (int64_t hb = 0; hb < static_cast<int64_t>(hbins.size()); ++hb) {
      for (int64_t hi = 0; hi < static_cast<int64_t>(hbins[hb].size()); ++hi) {
        const int64_t a = lengths[hbins[hb][hi]];
        if (a > c.budget) continue;
        for (int64_t lb = 0; lb < static_cast<int64_t>(lbins.size()); ++lb) {
          if (hbins[hb].size() >= 2 && fill[l][lb] + a <= c.budget) {
            consider(a, hb, hi, lb, -1);  // a move
          }
          for (int64_t li = 0; li < static_cast<int64_t>(lbins[lb].size());
               ++li) {
            const int64_t b = lengths[lbins[lb][li]];
            if (b > c.budget) continue;
            if (fill[h][hb] - a + b <= c.budget &&
                fill[l][lb] - b + a <= c.budget) {
              consider(a - b, hb, hi, lb, li);  // a swap
            }
          }
        }
      }
    }
    if (best_hb < 0) return;
    const int64_t a = hbins[best_hb][best_hi];
    if (best_li < 0) {
      hbins[best_hb].erase(hbins[best_hb].begin() + best_hi);
      lbins[best_lb].push_back(a);
    } else {
      std::swap(hbins[best_hb][best_hi], lbins[best_lb][best_li]);
    }
    fill[h][best_hb] -= best_d;
    fill[l][best_lb] += best_d;
    tokens[h] -= best_d;
    tokens[l] += best_d;
  }
}

}  // namespace

namespace planner_internal {

std::vector<std::vector<int64_t>> KarmarkarKarp(
    absl::Span<const int64_t> lengths, const std::vector<int64_t>& items,
    int64_t k, bool equal_size) {
  struct Set {
    int64_t sum = 0;
    std::vector<int64_t> items;
  };
  struct State {
    std::vector<Set> sets;  // heaviest first
    int64_t spread() const { return sets.front().sum - sets.back().sum; }
  };
  auto sort_sets = [](State& s) {
    std::stable_sort(s.sets.begin(), s.sets.end(),
                     [](const Set& a, const Set& b) { return a.sum > b.sum; });
  };
  auto less = [](const State& a, const State& b) {
    if (a.spread() != b.spread()) return a.spread() < b.spread();
    return a.sets.front().sum < b.sets.front().sum;
  };
  std::priority_queue<State, std::vector<State>, decltype(less)> heap(less);
  std::vector<int64_t> sorted = items;
  std::stable_sort(sorted.begin(), sorted.end(), [&](int64_t a, int64_t b) {
    return lengths[a] < lengths[b];
  });
  const int64_t group = equal_size ? k : 1;
  for (size_t at = 0; at < sorted.size(); at += group) {
    State s;
    s.sets.resize(k);
    for (int64_t j = 0; j < group && at + j < sorted.size(); ++j) {
      s.sets[j].items.push_back(sorted[at + j]);
      s.sets[j].sum = lengths[sorted[at + j]];
    }
    sort_sets(s);
    heap.push(std::move(s));
  }
  if (heap.empty()) return std::vector<std::vector<int64_t>>(k);
  while (heap.size() > 1) {
    State a = heap.top();
    heap.pop();
    State b = heap.top();
    heap.pop();
    for (int64_t j = 0; j < k; ++j) {
      Set& into = a.sets[j];
      Set& from = b.sets[k - 1 - j];
      into.sum += from.sum;
      into.items.insert(into.items.end(), from.items.begin(), from.items.end());
    }
    sort_sets(a);
    heap.push(std::move(a));
  }
  std::vector<std::vector<int64_t>> out;
  for (Set& s : const_cast<State&>(heap.top()).sets) {
    out.push_back(std::move(s.items));
  }
  return out;
}

}  // namespace planner_internal

namespace {

// First-fit decreasing of `samples` into micro-batches of the budget (a sample
// over it alone).
std::vector<std::vector<int64_t>> FirstFitDecreasing(
    absl::Span<const int64_t> lengths, std::vector<int64_t> samples,
    int64_t budget) {
  std::stable_sort(samples.begin(), samples.end(), [&](int64_t a, int64_t b) {
    return lengths[a] > lengths[b];
  });
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> fill;
  for (int64_t i : samples) {
    size_t b = 0;
    if (lengths[i] <= budget) {
      while (b < bins.size() && fill[b] + lengths[i] > budget) ++b;
    } else {
      b = bins.size();
    }
    if (b == bins.size()) {
      bins.emplace_back();
      fill.push_back(0);
    }
    bins[b].push_back(i);
    fill[b] += lengths[i];
  }
  return bins;
}

// Ranks balanced by Karmarkar-Karp (no equal counts), each rank packed first
// fit decreasing; micro-batches per rank: the most any rank needs.
Bins BalanceThenPack(absl::Span<const int64_t> lengths, const Checked& c);

// Whether plan a is better than b: fewer micro-batches per rank, then a lower
// imbalance.
bool Better(const Plan& a, const Plan& b) {
  if (a.micro_batches_per_rank != b.micro_batches_per_rank) {
    return a.micro_batches_per_rank < b.micro_batches_per_rank;
  }
  return a.imbalance < b.imbalance;
}

}  // namespace

int64_t MicroBatchLowerBound(absl::Span<const int64_t> lengths,
                             const PlanOptions& options) {
  absl::StatusOr<Checked> c = Validate(lengths, {}, options);
  return c.ok() ? LowerBound(*c) : 0;
}

absl::StatusOr<Plan> PlanMicroBatches(absl::Span<const int64_t> lengths,
                                      absl::Span<const int64_t> loss_tokens,
                                      const PlanOptions& options) {
  absl::StatusOr<Checked> c = Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  const std::vector<int64_t> order = LongestFirst(lengths);
  int64_t oversize = 0;
  for (int64_t len : lengths) oversize += len > c->budget;
  int64_t m = std::max(
      LowerBound(*c),
      RoundUp(std::max<int64_t>(1, (oversize + c->ranks - 1) / c->ranks),
              c->multiple));
  // Two packings: greedy (longest first to the lightest rank with room) from
  // the bound up, and Karmarkar-Karp ranks packed first fit decreasing (finer
  // balance, and for few samples); the better one wins.
  const bool few =
      static_cast<int64_t>(lengths.size()) <= kBalancedPackingMaxSamples;
  // Refinement rounds: enough to walk every rank pair a few times, within
  // about 4e6 sample pairs compared in all (a round compares the heaviest
  // rank's samples with the lightest's).
  const int64_t per_rank = static_cast<int64_t>(lengths.size()) / c->ranks + 1;
  const int rounds = static_cast<int>(std::clamp<int64_t>(
      int64_t{4000000} / (per_rank * per_rank), 8, 2 * c->ranks + 16));
  Bins bins;
  while (!TryPack(lengths, order, *c, m, &bins)) m += c->multiple;
  FillEmpty(lengths, &bins);
  Refine(lengths, *c, rounds, &bins);
  Plan greedy = Assemble(std::move(bins), lengths, loss_tokens);
  if (!few) return greedy;
  Bins balanced_bins = BalanceThenPack(lengths, *c);
  Refine(lengths, *c, rounds, &balanced_bins);
  Plan balanced = Assemble(std::move(balanced_bins), lengths, loss_tokens);
  return Better(balanced, greedy) ? balanced : greedy;
}

namespace {

Bins BalanceThenPack(absl::Span<const int64_t> lengths, const Checked& c) {
  std::vector<int64_t> all(lengths.size());
  std::iota(all.begin(), all.end(), 0);
  Bins bins;
  int64_t m = 1;
  for (std::vector<int64_t>& rank :
       KarmarkarKarp(lengths, all, c.ranks, /*equal_size=*/false)) {
    bins.push_back(FirstFitDecreasing(lengths, std::move(rank), c.budget));
    m = std::max<int64_t>(m, bins.back().size());
  }
  m = RoundUp(m, c.multiple);
  for (auto& rank : bins) rank.resize(m);
  FillEmpty(lengths, &bins);
  return bins;
}

}  // namespace

absl::Status CheckPlan(const Plan& plan, absl::Span<const int64_t> lengths,
                       absl::Span<const int64_t> loss_tokens,
                       const PlanOptions& options) {
  absl::StatusOr<Checked> c = Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  auto broken = [](auto... what) {
    return absl::InternalError(absl::StrCat("plan breaks: ", what...));
  };
  const int64_t m = plan.micro_batches_per_rank;
  if (m <= 0 || m % c->multiple != 0) {
    return broken("micro_batches_per_rank ", m,
                  " is not a positive multiple of ", c->multiple);
  }
  int64_t slots;
  if (__builtin_mul_overflow(m, int64_t{c->ranks}, &slots) ||
      static_cast<int64_t>(plan.micro_batches.size()) != slots) {
    return broken(plan.micro_batches.size(), " micro-batches for ", c->ranks,
                  " ranks of ", m);
  }
  std::vector<int> seen(lengths.size(), 0);
  int64_t loss = 0, empty = 0;
  for (size_t j = 0; j < plan.micro_batches.size(); ++j) {
    const MicroBatch& mb = plan.micro_batches[j];
    if (mb.rank != static_cast<int32_t>(j / m)) {
      return broken("micro-batch ", j, " has rank ", mb.rank);
    }
    int64_t tokens = 0, mb_loss = 0;
    for (int64_t i : mb.samples) {
      if (i < 0 || i >= static_cast<int64_t>(lengths.size()) || seen[i]++) {
        return broken("sample ", i, " is out of range or placed twice");
      }
      tokens += lengths[i];
      mb_loss += loss_tokens.empty() ? lengths[i] : loss_tokens[i];
    }
    if (tokens != mb.tokens || mb_loss != mb.loss_tokens) {
      return broken("micro-batch ", j, " sums are wrong");
    }
    if (tokens > c->budget && mb.samples.size() > 1) {
      return broken("micro-batch ", j, " holds ", tokens, " tokens in ",
                    mb.samples.size(), " samples, over the budget ", c->budget);
    }
    empty += mb.samples.empty();
    loss += mb_loss;
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != 1) return broken("sample ", i, " is not placed");
  }
  if (empty > 0 && static_cast<int64_t>(lengths.size()) >= slots) {
    return broken(empty, " empty micro-batches with ", lengths.size(),
                  " samples for ", slots, " micro-batches");
  }
  if (loss != plan.global_loss_tokens) {
    return broken("global_loss_tokens ", plan.global_loss_tokens, " != ", loss);
  }
  return absl::OkStatus();
}

}  // namespace packd
