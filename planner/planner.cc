#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <queue>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "planner/internal/planner_internal.h"

namespace packd {

using namespace planner_internal;  // NOLINT: this file defines them

namespace {

// Token sums the planner accepts: the loss is divided by global_loss_tokens,
// a double in every trainer, exact up to 2^53; padded sums as well, so that
// costs of padded lengths are exact too.
constexpr int64_t kMaxTotalTokens = int64_t{1} << 53;

// The local search's work, in units compared: a few milliseconds here, and
// room for hundreds of changes on a batch of a thousand samples.
constexpr int64_t kSearchWork = 6'000'000;

// The least gain, relative to the cost it lowers, that a change of the local
// search must bring: below it, costs are level to within rounding noise.
constexpr double kLeastGain = 1e-12;

// The most units of a rank that the search for one-for-two swaps takes.
constexpr size_t kMostPairPartners = 512;

absl::Status CheckCost(double v, absl::string_view what) {
  if (std::isfinite(v) && v >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " is ", v, ": costs must be finite and not negative"));
}

// The units of `groups` (empty: one per sample), ordered by first sample.
void MakeUnits(absl::Span<const int64_t> groups, const Checked& c,
               Units* units) {
  const int64_t n = static_cast<int64_t>(c.padded.size());
  units->samples.resize(n);
  std::iota(units->samples.begin(), units->samples.end(), 0);
  if (groups.empty()) {
    units->padded = c.padded;
    units->cost = c.cost;
    units->begin.resize(n + 1);
    std::iota(units->begin.begin(), units->begin.end(), 0);
    return;
  }
  // By group, then index: each group's samples become consecutive; the
  // units are then ordered by their first sample.
  std::sort(units->samples.begin(), units->samples.end(),
            [&](int64_t a, int64_t b) {
              return groups[a] != groups[b] ? groups[a] < groups[b] : a < b;
            });
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first sample, start)
  for (int64_t at = 0; at < n; ++at) {
    if (at == 0 ||
        groups[units->samples[at]] != groups[units->samples[at - 1]]) {
      runs.push_back({units->samples[at], at});
    }
  }
  std::sort(runs.begin(), runs.end());
  std::vector<int64_t> ordered;
  ordered.reserve(n);
  for (const auto& [first, start] : runs) {
    units->begin.push_back(static_cast<int64_t>(ordered.size()));
    int64_t padded = 0;
    double cost = 0;
    for (int64_t at = start;
         at < n && groups[units->samples[at]] == groups[units->samples[start]];
         ++at) {
      const int64_t i = units->samples[at];
      ordered.push_back(i);
      padded += c.padded[i];
      cost += c.cost[i];
    }
    units->padded.push_back(padded);
    units->cost.push_back(cost);
  }
  units->begin.push_back(n);
  units->samples = std::move(ordered);
}

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
  if (options.num_ranks < 0 || options.micro_batch_multiple < 0 ||
      options.pad_multiple < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_ranks (", options.num_ranks, "), micro_batch_multiple (",
        options.micro_batch_multiple, ") and pad_multiple (",
        options.pad_multiple, ") must not be negative"));
  }
  PACKD_RETURN_IF_ERROR(CheckCost(options.cost_per_token, "cost_per_token"));
  PACKD_RETURN_IF_ERROR(
      CheckCost(options.cost_per_token_squared, "cost_per_token_squared"));
  c.budget = options.max_tokens_per_micro_batch;
  c.ranks = std::max<int32_t>(1, options.num_ranks);
  c.multiple = std::max<int32_t>(1, options.micro_batch_multiple);
  const int64_t pad = std::max<int64_t>(1, options.pad_multiple);
  auto one_per_sample = [&](size_t size, absl::string_view name) {
    if (size == 0 || size == lengths.size()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", size, " entries but lengths has ",
                     lengths.size(), ": give one per sample, or none"));
  };
  PACKD_RETURN_IF_ERROR(one_per_sample(loss_tokens.size(), "loss_tokens"));
  PACKD_RETURN_IF_ERROR(one_per_sample(options.costs.size(), "costs"));
  PACKD_RETURN_IF_ERROR(one_per_sample(options.groups.size(), "groups"));
  const bool model_is_tokens =
      options.cost_per_token == 0 && options.cost_per_token_squared == 0;
  c.padded.resize(lengths.size());
  c.cost.resize(lengths.size());
  int64_t padded_total = 0, loss_total = 0;
  double cost_total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "] is ", lengths[i], ", below 0"));
    }
    if (!loss_tokens.empty()) {
      if (loss_tokens[i] < 0 ||
          (options.loss_tokens_within_lengths && loss_tokens[i] > lengths[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("loss_tokens[", i, "] is ", loss_tokens[i],
                         options.loss_tokens_within_lengths
                             ? absl::StrCat("; it must be in [0, lengths[", i,
                                            "] = ", lengths[i], "]")
                             : "; it must not be negative"));
      }
      if (__builtin_add_overflow(loss_total, loss_tokens[i], &loss_total) ||
          loss_total > kMaxTotalTokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the sum of loss_tokens passes 2^53 (", kMaxTotalTokens,
            ") tokens at loss_tokens[", i,
            "]: global_loss_tokens would not be exact as a double"));
      }
    }
    if (__builtin_add_overflow(c.total, lengths[i], &c.total) ||
        c.total > kMaxTotalTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("the sum of lengths passes 2^53 (", kMaxTotalTokens,
                       ") tokens at lengths[", i,
                       "]: global_loss_tokens would not be exact as a double"));
    }
    // ceil(L / pad) * pad, without overflow: L is at most 2^53 here.
    const int64_t blocks = lengths[i] / pad + (lengths[i] % pad != 0);
    if (__builtin_mul_overflow(blocks, pad, &c.padded[i]) ||
        __builtin_add_overflow(padded_total, c.padded[i], &padded_total) ||
        padded_total > kMaxTotalTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the lengths padded to multiples of ", pad,
          " pass 2^53 tokens at lengths[", i, "]: lower pad_multiple"));
    }
    const double p = static_cast<double>(c.padded[i]);
    if (!options.costs.empty()) {
      PACKD_RETURN_IF_ERROR(
          CheckCost(options.costs[i], absl::StrCat("costs[", i, "]")));
      c.cost[i] = options.costs[i];
    } else {
      c.cost[i] = model_is_tokens ? p
                                  : options.cost_per_token * p +
                                        options.cost_per_token_squared * p * p;
      if (!std::isfinite(c.cost[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("the cost model makes sample ", i, " (", c.padded[i],
                         " padded tokens) cost infinity: lower the "
                         "coefficients"));
      }
    }
    cost_total += c.cost[i];
  }
  if (!std::isfinite(cost_total)) {
    return absl::InvalidArgumentError(
        "the samples' costs sum to infinity: scale them down");
  }
  MakeUnits(options.groups, c, &c.units);
  for (int64_t p : c.units.padded) c.capped_total += std::min(p, c.budget);
  // A budget above the total fits every unit, as the total does: plan with
  // the smaller, so sums of fills and budgets stay far from int64's limit.
  c.budget = std::min(c.budget, std::max<int64_t>(1, padded_total));
  return c;
}

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

int64_t LowerBound(const Checked& c) {
  int64_t capacity;
  // Capacity past int64 holds any capped total (at most 2^53): one suffices.
  const int64_t bound =
      __builtin_mul_overflow(int64_t{c.ranks}, c.budget, &capacity)
          ? 1
          : c.capped_total / capacity + (c.capped_total % capacity != 0);
  return RoundUp(std::max<int64_t>(1, bound), c.multiple);
}

std::vector<int64_t> AllUnits(const Checked& c) {
  std::vector<int64_t> all(c.units.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
}

std::vector<double> PaddedValues(const Checked& c) {
  return std::vector<double>(c.units.padded.begin(), c.units.padded.end());
}

std::optional<std::vector<std::vector<int64_t>>> FirstFit(const Checked& c,
                                                          int64_t slots) {
  int64_t leaves = 1;
  while (leaves < slots) leaves *= 2;
  // room[leaves + b]: micro-batch b's room (the budget, less its fill; an
  // empty one takes any unit, one over the budget none); room[i]: the most
  // of its subtree. The first micro-batch with room is found from the root.
  constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> room(2 * leaves, -1);
  for (int64_t b = 0; b < slots; ++b) room[leaves + b] = kAny;
  for (int64_t i = leaves - 1; i >= 1; --i) {
    room[i] = std::max(room[2 * i], room[2 * i + 1]);
  }
  std::vector<std::vector<int64_t>> batches(slots);
  std::vector<int64_t> fill(slots, 0);
  int64_t used = 0;
  for (int64_t u = 0; u < c.units.size(); ++u) {
    const int64_t need = c.units.padded[u];
    if (room[1] < need) return std::nullopt;
    int64_t i = 1;
    while (i < leaves) i = room[2 * i] >= need ? 2 * i : 2 * i + 1;
    const int64_t b = i - leaves;
    batches[b].push_back(u);
    fill[b] += need;
    used = std::max(used, b + 1);
    room[i] = need > c.budget ? -1 : c.budget - fill[b];
    for (i /= 2; i >= 1; i /= 2) {
      room[i] = std::max(room[2 * i], room[2 * i + 1]);
    }
  }
  batches.resize(used);
  return batches;
}

Bins SplitAndDeal(const Checked& c, std::vector<std::vector<int64_t>> batches,
                  int64_t m) {
  const int64_t slots = int64_t{c.ranks} * m;
  const std::vector<double> padded = PaddedValues(c);
  std::vector<int64_t> fill;
  // The fullest micro-batch of several units first (ties: the first).
  std::priority_queue<std::pair<int64_t, int64_t>> splittable;
  auto offer = [&](int64_t b) {
    fill.resize(batches.size());
    fill[b] = 0;
    for (int64_t u : batches[b]) fill[b] += c.units.padded[u];
    if (batches[b].size() >= 2) splittable.push({fill[b], -b});
  };
  for (int64_t b = 0; b < static_cast<int64_t>(batches.size()); ++b) offer(b);
  while (static_cast<int64_t>(batches.size()) < slots && !splittable.empty()) {
    const int64_t largest = -splittable.top().second;
    splittable.pop();
    std::vector<std::vector<int64_t>> halves =
        KarmarkarKarp(padded, batches[largest], 2, /*equal_size=*/false);
    batches[largest] = std::move(halves[0]);
    batches.push_back(std::move(halves[1]));
    offer(largest);
    offer(static_cast<int64_t>(batches.size()) - 1);
  }
  batches.resize(slots);  // empty ones, when nothing is left to split
  std::vector<double> cost(slots, 0);
  for (int64_t b = 0; b < slots; ++b) {
    for (int64_t u : batches[b]) cost[b] += c.units.cost[u];
  }
  std::vector<int64_t> all(slots);
  std::iota(all.begin(), all.end(), 0);
  Bins bins;
  for (const std::vector<int64_t>& rank :
       KarmarkarKarp(cost, all, c.ranks, /*equal_size=*/true)) {
    bins.emplace_back();
    for (int64_t b : rank) bins.back().push_back(std::move(batches[b]));
  }
  return bins;
}

std::vector<std::vector<int64_t>> RanksByTokens(const Checked& c) {
  return KarmarkarKarp(PaddedValues(c), AllUnits(c), c.ranks,
                       c.units.size() % c.ranks == 0);
}

std::optional<Bins> SplitByCost(const Checked& c,
                                const std::vector<std::vector<int64_t>>& ranks,
                                int64_t m) {
  Bins bins;
  for (const std::vector<int64_t>& rank : ranks) {
    bins.push_back(KarmarkarKarp(c.units.cost, rank, m, /*equal_size=*/false));
    for (const std::vector<int64_t>& b : bins.back()) {
      int64_t fill = 0;
      for (int64_t u : b) fill += c.units.padded[u];
      if (!KeepsCap(c, fill, b.size())) return std::nullopt;
    }
  }
  return bins;
}

Plan Assemble(const Bins& bins, const Checked& c,
              absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> loss_tokens) {
  Plan plan;
  plan.micro_batches_per_rank = bins.empty() ? 0 : bins[0].size();
  int64_t max_rank = 0, total = 0;
  double max_rank_cost = 0, total_cost = 0;
  for (size_t r = 0; r < bins.size(); ++r) {
    int64_t rank_tokens = 0;
    double rank_cost = 0;
    for (const std::vector<int64_t>& units : bins[r]) {
      MicroBatch mb;
      mb.rank = static_cast<int32_t>(r);
      for (int64_t u : units) {
        mb.samples.insert(mb.samples.end(),
                          c.units.samples.begin() + c.units.begin[u],
                          c.units.samples.begin() + c.units.begin[u + 1]);
      }
      std::sort(mb.samples.begin(), mb.samples.end());
      for (int64_t i : mb.samples) {
        const int64_t loss = loss_tokens.empty() ? lengths[i] : loss_tokens[i];
        mb.tokens += lengths[i];
        mb.loss_tokens += loss;
        mb.padded_tokens += c.padded[i];
        mb.cost += c.cost[i];
        plan.global_sequences += loss > 0;
      }
      rank_tokens += mb.tokens;
      rank_cost += mb.cost;
      plan.global_loss_tokens += mb.loss_tokens;
      plan.micro_batches.push_back(std::move(mb));
    }
    max_rank = std::max(max_rank, rank_tokens);
    total += rank_tokens;
    max_rank_cost = std::max(max_rank_cost, rank_cost);
    total_cost += rank_cost;
  }
  plan.imbalance =
      total == 0 ? 1.0 : static_cast<double>(max_rank) * bins.size() / total;
  plan.cost_imbalance =
      total_cost == 0 ? 1.0 : max_rank_cost * bins.size() / total_cost;
  return plan;
}

std::vector<std::vector<int64_t>> KarmarkarKarp(
    absl::Span<const double> value, const std::vector<int64_t>& items,
    int64_t k, bool equal_size) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<std::pair<double, int64_t>> keyed(n);
  for (int64_t j = 0; j < n; ++j) keyed[j] = {value[items[j]], items[j]};
  std::sort(keyed.begin(), keyed.end());
  // A set: its sum and a list of positions in `keyed`, linked by `next`.
  struct Set {
    double sum;
    int64_t head, tail;
  };
  // A partial solution's non-empty sets, heaviest first (the other k -
  // size() are empty), kept apart from the heap, which holds only what it
  // orders by: the spread, the heaviest sum, the solution's age.
  std::vector<std::vector<Set>> solutions;
  struct Entry {
    double spread, heaviest;
    int64_t id;    // breaks ties, the oldest first, so the order is total
    int64_t slot;  // its sets: solutions[slot]
  };
  // The heap's top: the largest spread, then the heaviest set, then the
  // oldest solution.
  auto lower = [](const Entry& a, const Entry& b) {
    if (a.spread != b.spread) return a.spread < b.spread;
    if (a.heaviest != b.heaviest) return a.heaviest < b.heaviest;
    return a.id > b.id;
  };
  auto entry_of = [&](const std::vector<Set>& sets, int64_t id, int64_t slot) {
    const double lightest =
        static_cast<int64_t>(sets.size()) < k ? 0 : sets.back().sum;
    return Entry{sets.front().sum - lightest, sets.front().sum, id, slot};
  };
  auto heavier = [](const Set& a, const Set& b) {
    return a.sum != b.sum ? a.sum > b.sum : a.head < b.head;
  };
  std::vector<int64_t> next(n, -1);
  std::vector<Entry> heap;
  // Items entering one by one wait in `keyed` rather than the heap: the
  // first `singles` positions, which leave heaviest first (an item's spread
  // is its value), the last one the oldest.
  int64_t singles = 0, ids = n;
  if (equal_size && k > 1) {
    for (int64_t at = 0; at < n; at += k) {
      std::vector<Set> sets;
      for (int64_t j = at; j < at + k && j < n; ++j) {
        sets.push_back({keyed[j].first, j, j});
      }
      std::sort(sets.begin(), sets.end(), heavier);
      heap.push_back(entry_of(sets, ids++, solutions.size()));
      solutions.push_back(std::move(sets));
    }
    std::make_heap(heap.begin(), heap.end(), lower);
  } else {
    singles = n;
  }
  auto single = [&](int64_t j) {
    return entry_of({{keyed[j].first, j, j}}, n - 1 - j, -1);
  };
  // The slot of the next solution to merge.
  auto take = [&]() {
    if (singles > 0 &&
        (heap.empty() || lower(heap.front(), single(singles - 1)))) {
      --singles;
      solutions.push_back({{keyed[singles].first, singles, singles}});
      return static_cast<int64_t>(solutions.size()) - 1;
    }
    std::pop_heap(heap.begin(), heap.end(), lower);
    const int64_t slot = heap.back().slot;
    heap.pop_back();
    return slot;
  };
  std::vector<Set> touched;
  while (static_cast<int64_t>(heap.size()) + singles > 1) {
    const int64_t into = take();
    std::vector<Set> b = std::move(solutions[take()]);
    std::vector<Set>& merged = solutions[into];
    // Set j of the merge: a's j-th heaviest with b's (k-1-j)-th. a's sets
    // before k - nb are untouched, still heaviest first; only those from
    // there on (b's sets, and a's they join) need sorting before the two
    // runs are merged, in place, from the lightest end.
    const int64_t na = static_cast<int64_t>(merged.size());
    const int64_t nb = static_cast<int64_t>(b.size());
    const int64_t untouched = std::min(na, k - nb);
    touched.clear();
    for (int64_t j = k - nb; j < k; ++j) {
      Set t = b[k - 1 - j];
      if (j < na) {
        Set s = merged[j];
        s.sum += t.sum;
        next[s.tail] = t.head;
        s.tail = t.tail;
        t = s;
      }
      touched.push_back(t);
    }
    std::sort(touched.begin(), touched.end(), heavier);
    merged.resize(untouched + nb);
    int64_t i = untouched - 1, t = nb - 1;
    for (int64_t out = untouched + nb - 1; t >= 0; --out) {
      if (i >= 0 && heavier(touched[t], merged[i])) {
        merged[out] = merged[i--];
      } else {
        merged[out] = touched[t--];
      }
    }
    heap.push_back(entry_of(merged, ids++, into));  // the youngest
    std::push_heap(heap.begin(), heap.end(), lower);
  }
  std::vector<std::vector<int64_t>> out(k);
  if (n == 0) return out;
  const std::vector<Set>& last = singles == 1
                                     ? std::vector<Set>{{keyed[0].first, 0, 0}}
                                     : solutions[heap.front().slot];
  for (size_t s = 0; s < last.size(); ++s) {
    for (int64_t at = last[s].head; at >= 0; at = next[at]) {
      out[s].push_back(keyed[at].second);
    }
  }
  return out;
}

}  // namespace planner_internal

namespace {

using Slot = std::pair<int32_t, int64_t>;  // (rank, micro-batch)

// A packing under way: the units of each micro-batch of each rank, with
// every micro-batch's padded tokens and cost, and every rank's cost.
struct Packing {
  Packing(const Checked& checked, int64_t m)
      : c(&checked),
        bins(checked.ranks, std::vector<std::vector<int64_t>>(m)),
        fill(checked.ranks, std::vector<int64_t>(m, 0)),
        cost(checked.ranks, std::vector<double>(m, 0)),
        rank_cost(checked.ranks, 0),
        rank_fill(checked.ranks, 0) {}

  int64_t m() const { return static_cast<int64_t>(bins[0].size()); }
  int64_t units(int32_t r, int64_t b) const {
    return static_cast<int64_t>(bins[r][b].size());
  }
  bool Fits(int32_t r, int64_t b, int64_t u) const {
    return KeepsCap(*c, fill[r][b] + c->units.padded[u], bins[r][b].size() + 1);
  }
  void Put(int32_t r, int64_t b, int64_t u) {
    bins[r][b].push_back(u);
    Account(r, b, u, +1);
  }
  // Removes the unit at `pos` of micro-batch (r, b) and returns it.
  int64_t Take(int32_t r, int64_t b, int64_t pos) {
    std::vector<int64_t>& bin = bins[r][b];
    const int64_t u = bin[pos];
    bin.erase(bin.begin() + pos);
    Account(r, b, u, -1);
    return u;
  }
  void Account(int32_t r, int64_t b, int64_t u, int sign) {
    fill[r][b] += sign * c->units.padded[u];
    rank_fill[r] += sign * c->units.padded[u];
    cost[r][b] += sign * c->units.cost[u];
    rank_cost[r] += sign * c->units.cost[u];
  }
  double MaxRankCost() const {
    return *std::max_element(rank_cost.begin(), rank_cost.end());
  }

  const Checked* c;
  Bins bins;
  std::vector<std::vector<int64_t>> fill;
  std::vector<std::vector<double>> cost;
  std::vector<double> rank_cost;
  std::vector<int64_t> rank_fill;
};

// `units` sorted costliest first (ties: the most padded tokens, then the
// lowest index), or with by_cost false, most padded tokens first (ties: the
// costliest). Sorted by value, not through the units' arrays: the largest
// batches sort 65,536 units several times.
void SortDescending(const Checked& c, bool by_cost,
                    std::vector<int64_t>* units) {
  const Units& u = c.units;
  std::vector<std::tuple<double, double, int64_t>> keys(units->size());
  for (size_t j = 0; j < units->size(); ++j) {
    const int64_t i = (*units)[j];
    const double cost = -u.cost[i], padded = -static_cast<double>(u.padded[i]);
    keys[j] = by_cost ? std::make_tuple(cost, padded, i)
                      : std::make_tuple(padded, cost, i);
  }
  std::sort(keys.begin(), keys.end());
  for (size_t j = 0; j < keys.size(); ++j) (*units)[j] = std::get<2>(keys[j]);
}

std::vector<int64_t> Descending(const Checked& c, bool by_cost) {
  std::vector<int64_t> order = AllUnits(c);
  SortDescending(c, by_cost, &order);
  return order;
}

// The fullest micro-batch of rank r that unit u fits, or -1.
int64_t FullestFit(const Packing& p, int32_t r, int64_t u) {
  const int64_t padded = p.c->units.padded[u];
  const std::vector<int64_t>& fill = p.fill[r];
  const int64_t m = static_cast<int64_t>(fill.size());
  if (padded > p.c->budget) {  // alone: the first empty micro-batch
    for (int64_t b = 0; b < m; ++b) {
      if (p.bins[r][b].empty()) return b;
    }
    return -1;
  }
  const int64_t limit = p.c->budget - padded;
  int64_t best = -1, best_fill = -1;
  for (int64_t b = 0; b < m; ++b) {
    if (fill[b] <= limit && fill[b] > best_fill) {
      best = b;
      best_fill = fill[b];
    }
  }
  return best;
}

// A min-heap of (key, id) in a vector: the order of a std::set without a
// node per change. First(ok) takes out the least entry ok accepts, putting
// back those it passed.
template <typename Key>
class MinHeap {
 public:
  void Push(Key key) {
    heap_.push_back(key);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
  }
  template <typename Ok>
  std::optional<Key> First(Ok ok) {
    std::optional<Key> found;
    passed_.clear();
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
      Key top = heap_.back();
      heap_.pop_back();
      if (ok(top)) {
        found = top;
        break;
      }
      passed_.push_back(top);
    }
    for (const Key& k : passed_) Push(k);
    return found;
  }

 private:
  std::vector<Key> heap_, passed_;
};

// Ranks ordered by what a greedy packing balances, cost or padded tokens,
// for picking the least that has room.
class CheapestRanks {
 public:
  CheapestRanks(const Packing& p, bool by_cost) : by_cost_(by_cost) {
    for (int32_t r = 0; r < p.c->ranks; ++r) ranks_.Push({KeyOf(p, r), r});
  }
  // Places `u` in the least rank with room, into its fullest micro-batch the
  // unit fits. False when it fits nowhere.
  bool Place(Packing* p, int64_t u) {
    int64_t b = -1;
    const auto rank = ranks_.First([&](const std::pair<double, int32_t>& e) {
      b = FullestFit(*p, e.second, u);
      return b >= 0;
    });
    if (!rank) return false;
    p->Put(rank->second, b, u);
    ranks_.Push({KeyOf(*p, rank->second), rank->second});
    return true;
  }

 private:
  double KeyOf(const Packing& p, int32_t r) const {
    return by_cost_ ? p.rank_cost[r] : static_cast<double>(p.rank_fill[r]);
  }
  bool by_cost_;
  MinHeap<std::pair<double, int32_t>> ranks_;
};

// Ranks by cost, for the local search.
using RankOrder = std::set<std::pair<double, int32_t>>;

RankOrder OrderOf(const Packing& p) {
  RankOrder order;
  for (int32_t r = 0; r < p.c->ranks; ++r) order.insert({p.rank_cost[r], r});
  return order;
}

// Longest processing time first: units costliest first (or longest), each to
// the cheapest rank (or the one with the fewest tokens) that has room, into
// its fullest micro-batch the unit fits (which keeps room for what follows).
// False when some unit fits nowhere.
// `order` is Descending(c, by_cost).
bool Greedy(const Checked& c, const std::vector<int64_t>& order, int64_t m,
            bool by_cost, Packing* p) {
  *p = Packing(c, m);
  CheapestRanks ranks(*p, by_cost);
  for (int64_t u : order) {
    if (!ranks.Place(p, u)) return false;
  }
  return true;
}

// The ranks of a Karmarkar-Karp partition by cost, each packed first fit
// decreasing (by padded tokens) into m micro-batches; the units a rank cannot
// hold then go, costliest first, to the cheapest rank with room. False when
// one fits nowhere.
bool Differenced(const Checked& c,
                 const std::vector<std::vector<int64_t>>& partition, int64_t m,
                 Packing* p) {
  *p = Packing(c, m);
  std::vector<int64_t> left;
  for (int32_t r = 0; r < c.ranks; ++r) {
    std::vector<int64_t> units = partition[r];
    SortDescending(c, /*by_cost=*/false, &units);
    for (int64_t u : units) {
      int64_t b = 0;
      while (b < m && !p->Fits(r, b, u)) ++b;
      if (b < m) {
        p->Put(r, b, u);
      } else {
        left.push_back(u);
      }
    }
  }
  SortDescending(c, /*by_cost=*/true, &left);
  CheapestRanks ranks(*p, /*by_cost=*/true);
  for (int64_t u : left) {
    if (!ranks.Place(p, u)) return false;
  }
  return true;
}

// The packing of `bins` (units per micro-batch, of each rank).
Packing PackingOf(const Checked& c, const Bins& bins) {
  Packing p(c, static_cast<int64_t>(bins[0].size()));
  for (int32_t r = 0; r < c.ranks; ++r) {
    for (size_t b = 0; b < bins[r].size(); ++b) {
      for (int64_t u : bins[r][b]) p.Put(r, static_cast<int64_t>(b), u);
    }
  }
  return p;
}

// Fills empty micro-batches while others hold several units: first from the
// same rank (rank costs unchanged), then from any rank. A moved unit comes
// from a micro-batch of several, so it is within the budget.
void FillEmpty(Packing* p) {
  auto move_smallest = [&](Slot from, Slot to) {
    const std::vector<int64_t>& bin = p->bins[from.first][from.second];
    const auto smallest =
        std::min_element(bin.begin(), bin.end(), [&](int64_t a, int64_t b) {
          return p->c->units.padded[a] < p->c->units.padded[b];
        });
    p->Put(to.first, to.second,
           p->Take(from.first, from.second, smallest - bin.begin()));
  };
  // Donors (micro-batches of two or more units), gathered once: a plan may
  // hold many empty micro-batches and few donors, so looking for a donor per
  // empty micro-batch would be quadratic.
  auto donors_of = [&](int32_t r, std::vector<Slot>* donors) {
    for (int64_t b = 0; b < p->m(); ++b) {
      if (p->units(r, b) >= 2) donors->push_back({r, b});
    }
  };
  auto fill = [&](int32_t r, const std::vector<Slot>& donors, size_t& next) {
    for (int64_t b = 0; b < p->m(); ++b) {
      if (p->units(r, b) != 0) continue;
      while (next < donors.size() &&
             p->units(donors[next].first, donors[next].second) < 2) {
        ++next;
      }
      if (next == donors.size()) return;
      move_smallest(donors[next], {r, b});
    }
  };
  for (int32_t r = 0; r < p->c->ranks; ++r) {
    std::vector<Slot> donors;
    donors_of(r, &donors);
    std::stable_sort(donors.begin(), donors.end(), [&](Slot a, Slot b) {
      return p->units(a.first, a.second) > p->units(b.first, b.second);
    });
    size_t next = 0;
    fill(r, donors, next);
  }
  std::vector<Slot> donors;
  for (int32_t r = 0; r < p->c->ranks; ++r) donors_of(r, &donors);
  size_t next = 0;
  for (int32_t r = 0; r < p->c->ranks; ++r) fill(r, donors, next);
}

// A move (to_pos < 0) of a unit from micro-batch `from` to `to`, or a swap
// of a unit of each; d is the cost it takes from the costlier side.
struct Change {
  int32_t from_rank;
  int64_t from_bin, from_pos;
  int32_t to_rank;
  int64_t to_bin, to_pos;
  double d;
  // With a second unit of `to`: the unit from `from` is swapped for two.
  int64_t to_bin2 = -1, to_pos2 = -1;
};

void Apply(const Change& ch, Packing* p) {
  const int64_t a = p->Take(ch.from_rank, ch.from_bin, ch.from_pos);
  if (ch.to_pos2 >= 0) {
    // From one micro-batch, the later position first, so the earlier one
    // stays where it is.
    const bool second_first = ch.to_bin2 == ch.to_bin && ch.to_pos2 > ch.to_pos;
    int64_t b1, b2;
    if (second_first) {
      b2 = p->Take(ch.to_rank, ch.to_bin2, ch.to_pos2);
      b1 = p->Take(ch.to_rank, ch.to_bin, ch.to_pos);
    } else {
      b1 = p->Take(ch.to_rank, ch.to_bin, ch.to_pos);
      b2 = p->Take(ch.to_rank, ch.to_bin2, ch.to_pos2);
    }
    p->Put(ch.from_rank, ch.from_bin, b1);
    p->Put(ch.from_rank, ch.from_bin, b2);
    p->Put(ch.to_rank, ch.to_bin, a);
    return;
  }
  if (ch.to_pos >= 0) {
    p->Put(ch.from_rank, ch.from_bin,
           p->Take(ch.to_rank, ch.to_bin, ch.to_pos));
  }
  p->Put(ch.to_rank, ch.to_bin, a);
}

// A unit of the cheaper side of a change, with its place, in cost order.
struct Partner {
  double cost;
  int64_t unit;
  Slot slot;
  int64_t pos;
  bool operator<(const Partner& o) const {
    return cost != o.cost ? cost < o.cost : unit < o.unit;
  }
};

// The units of the micro-batches `to`, sorted by cost, and the emptiest of
// them (the least padded tokens, then the fewest units): what a change
// into `to` searches.
std::vector<Partner> PartnersOf(const Packing& p, const std::vector<Slot>& to,
                                Slot* emptiest, int64_t* work) {
  std::vector<Partner> partners;
  *emptiest = to[0];
  auto load = [&](Slot s) {
    return std::make_pair(p.fill[s.first][s.second],
                          p.bins[s.first][s.second].size());
  };
  for (Slot t : to) {
    const std::vector<int64_t>& bin = p.bins[t.first][t.second];
    for (int64_t j = 0; j < static_cast<int64_t>(bin.size()); ++j) {
      partners.push_back({p.c->units.cost[bin[j]], bin[j], t, j});
    }
    if (load(t) < load(*emptiest)) *emptiest = t;
  }
  std::sort(partners.begin(), partners.end());
  *work -= static_cast<int64_t>(partners.size()) + 1;
  return partners;
}

// The partners b with tol < base - c_b < gap - tol that `feasible`
// accepts, nearest base - gap / 2 (where d = base - c_b halves the gap): the
// first feasible one outward in each direction is that direction's best, so
// each direction stops at it; `consider(b, d)` hears both. `skip` is a
// position of `partners` not to take.
template <typename Feasible, typename Consider>
void SearchOutward(const std::vector<Partner>& partners, double base,
                   double gap, double tol, int64_t skip, int64_t* work,
                   Feasible feasible, Consider consider) {
  const auto mid = std::lower_bound(partners.begin(), partners.end(),
                                    Partner{base - gap / 2, -1, {0, 0}, 0});
  *work -= 16;
  for (auto it = mid; it != partners.end(); ++it) {  // d <= gap / 2
    const double d = base - it->cost;
    if (d <= tol) break;
    --*work;
    if (it - partners.begin() != skip && d < gap - tol && feasible(*it)) {
      consider(*it, d);
      break;
    }
  }
  for (auto it = mid; it != partners.begin();) {  // d > gap / 2
    --it;
    const double d = base - it->cost;
    if (d >= gap - tol) break;
    --*work;
    if (it - partners.begin() != skip && d > tol && feasible(*it)) {
      consider(*it, d);
      break;
    }
  }
}

// The change between the micro-batches `from` (of the costlier side) and
// `to`, `gap` apart, that brings the two sides closest together, keeping
// the cap and leaving no micro-batch empty; none when every change would
// leave the larger side no smaller than now (by more than `tol`). A move
// of a unit a takes c_a: it goes to the emptiest of `to`, which holds it if
// any does. A swap with b takes c_a - c_b: `to`'s units sorted by cost,
// each a looks for b nearest c_a - gap / 2, outward in both directions, so
// the result is that of comparing every pair, at a fraction of the work.
std::optional<Change> BestChange(const Packing& p,
                                 const std::vector<Slot>& from,
                                 const std::vector<Slot>& to, double gap,
                                 double tol, int64_t* work) {
  const Units& units = p.c->units;
  Slot emptiest;
  const std::vector<Partner> partners = PartnersOf(p, to, &emptiest, work);
  const std::vector<int64_t>& ebin = p.bins[emptiest.first][emptiest.second];
  const int64_t efill = p.fill[emptiest.first][emptiest.second];
  std::optional<Change> best;
  auto consider = [&](double d, Slot f, int64_t fi, Slot t, int64_t ti) {
    if (!best || std::abs(gap - 2 * d) < std::abs(gap - 2 * best->d)) {
      best = Change{f.first, f.second, fi, t.first, t.second, ti, d};
    }
  };
  for (Slot f : from) {
    const std::vector<int64_t>& fbin = p.bins[f.first][f.second];
    const int64_t ffill = p.fill[f.first][f.second];
    for (int64_t fi = 0; fi < static_cast<int64_t>(fbin.size()); ++fi) {
      const double ca = units.cost[fbin[fi]];
      const int64_t pa = units.padded[fbin[fi]];
      if (ca <= tol) continue;
      if (fbin.size() >= 2 && ca < gap - tol &&
          KeepsCap(*p.c, efill + pa, ebin.size() + 1)) {
        consider(ca, f, fi, emptiest, -1);
      }
      SearchOutward(
          partners, ca, gap, tol, -1, work,
          [&](const Partner& b) {
            const int64_t pb = units.padded[b.unit];
            return KeepsCap(*p.c, ffill - pa + pb, fbin.size()) &&
                   KeepsCap(*p.c, p.fill[b.slot.first][b.slot.second] - pb + pa,
                            p.bins[b.slot.first][b.slot.second].size());
          },
          [&](const Partner& b, double d) {
            consider(d, f, fi, b.slot, b.pos);
          });
    }
  }
  return best;
}

// Where no move or swap helps (the cap full on both sides), a unit a of
// `from` swapped for two units of `to` (micro-batches of one rank) that
// together cost less and fit where a was: the pair (b1, b2) with c_a - c_b1
// - c_b2 nearest gap / 2, b2 searched as BestChange searches b.
std::optional<Change> BestPairChange(const Packing& p,
                                     const std::vector<Slot>& from,
                                     const std::vector<Slot>& to, double gap,
                                     double tol, int64_t* work) {
  // Quadratic in the units of `to`: for ranks of a few hundred, where the
  // cap binds hardest (large batches spread over many units level by
  // swaps).
  size_t count = 0;
  for (Slot t : to) count += p.bins[t.first][t.second].size();
  if (count > kMostPairPartners) return std::nullopt;
  const Units& units = p.c->units;
  Slot emptiest;
  const std::vector<Partner> partners = PartnersOf(p, to, &emptiest, work);
  std::optional<Change> best;
  for (Slot f : from) {
    if (*work <= 0) break;
    const std::vector<int64_t>& fbin = p.bins[f.first][f.second];
    const int64_t ffill = p.fill[f.first][f.second];
    for (int64_t fi = 0; fi < static_cast<int64_t>(fbin.size()); ++fi) {
      const double ca = units.cost[fbin[fi]];
      const int64_t pa = units.padded[fbin[fi]];
      *work -= 16 * static_cast<int64_t>(partners.size());
      for (size_t i = 0; i < partners.size(); ++i) {
        const Partner& b1 = partners[i];
        if (ca - b1.cost <= tol) break;  // the rest cost more
        const int64_t p1 = units.padded[b1.unit];
        const std::vector<int64_t>& bin1 =
            p.bins[b1.slot.first][b1.slot.second];
        const int64_t fill1 = p.fill[b1.slot.first][b1.slot.second];
        auto feasible = [&](const Partner& b2) {
          const int64_t p2 = units.padded[b2.unit];
          if (!KeepsCap(*p.c, ffill - pa + p1 + p2, fbin.size() + 1)) {
            return false;
          }
          if (b2.slot == b1.slot) {
            return KeepsCap(*p.c, fill1 - p1 - p2 + pa, bin1.size() - 1);
          }
          return p.bins[b2.slot.first][b2.slot.second].size() >= 2 &&
                 KeepsCap(*p.c, fill1 - p1 + pa, bin1.size());
        };
        auto consider = [&](const Partner& b2, double d) {
          if (!best || std::abs(gap - 2 * d) < std::abs(gap - 2 * best->d)) {
            best = Change{f.first,        f.second, fi, b1.slot.first,
                          b1.slot.second, b1.pos,   d,  b2.slot.second,
                          b2.pos};
          }
        };
        // d = ca - c_b1 - c_b2: b2 searched as a swap's partner of base
        // ca - c_b1.
        SearchOutward(partners, ca - b1.cost, gap, tol, static_cast<int64_t>(i),
                      work, feasible, consider);
      }
    }
  }
  return best;
}

std::vector<Slot> SlotsOf(const Packing& p, int32_t r) {
  std::vector<Slot> slots;
  for (int64_t b = 0; b < p.m(); ++b) slots.push_back({r, b});
  return slots;
}

// Lowers the largest rank cost: a move of a unit from the costliest rank to
// another, or a swap of a unit of each, the change that brings the two
// closest (else a swap of one unit for two); the other ranks tried cheapest
// first. Stops when the costliest
// rank gains from none, or the work is spent.
void BalanceRanks(Packing* p, int64_t* work) {
  if (p->c->ranks < 2) return;
  RankOrder order = OrderOf(*p);
  while (*work > 0) {
    const auto [high, h] = *order.rbegin();
    const double tol = high * kLeastGain;
    bool changed = false;
    for (auto it = order.begin(); it != order.end() && *work > 0; ++it) {
      const auto [low, l] = *it;
      // No change gains tol where the gap is under twice that; nor with
      // the ranks after, which are costlier.
      if (l == h || high - low < 2 * tol) break;
      const std::vector<Slot> from = SlotsOf(*p, h), to = SlotsOf(*p, l);
      std::optional<Change> ch =
          BestChange(*p, from, to, high - low, tol, work);
      if (!ch) ch = BestPairChange(*p, from, to, high - low, tol, work);
      if (!ch) continue;
      order.erase(std::prev(order.end()));
      order.erase(it);
      Apply(*ch, p);
      order.insert({p->rank_cost[h], h});
      order.insert({p->rank_cost[l], l});
      changed = true;
      break;
    }
    if (!changed) return;
  }
}

// Rank r's units repacked into its micro-batches, costliest first, each into
// the cheapest micro-batch it fits (ties: the one of fewer units); kept only
// when every unit fits and no micro-batch is left empty that was not.
void RepackRank(Packing* p, int32_t r) {
  const int64_t m = p->m();
  std::vector<int64_t> units;
  int64_t empty = 0;
  for (int64_t b = 0; b < m; ++b) {
    units.insert(units.end(), p->bins[r][b].begin(), p->bins[r][b].end());
    empty += p->bins[r][b].empty();
  }
  SortDescending(*p->c, /*by_cost=*/true, &units);
  const Units& u = p->c->units;
  std::vector<std::vector<int64_t>> bins(m);
  std::vector<int64_t> fill(m, 0);
  std::vector<double> cost(m, 0);
  // Micro-batches cheapest first (ties: fewer units, then the first).
  MinHeap<std::tuple<double, size_t, int64_t>> cheapest;
  for (int64_t b = 0; b < m; ++b) cheapest.Push({0.0, size_t{0}, b});
  for (int64_t unit : units) {
    const auto slot = cheapest.First([&](const auto& e) {
      const int64_t b = std::get<2>(e);
      return KeepsCap(*p->c, fill[b] + u.padded[unit], bins[b].size() + 1);
    });
    if (!slot) return;
    const int64_t b = std::get<2>(*slot);
    bins[b].push_back(unit);
    fill[b] += u.padded[unit];
    cost[b] += u.cost[unit];
    cheapest.Push({cost[b], bins[b].size(), b});
  }
  int64_t now_empty = 0;
  for (const auto& bin : bins) now_empty += bin.empty();
  if (now_empty > empty) return;
  p->bins[r] = std::move(bins);
  p->fill[r] = std::move(fill);
  p->cost[r] = std::move(cost);
}

// Balances the micro-batches within each rank (the rank costs do not
// change): a repacking by cost, then changes between the costliest and the
// cheapest micro-batch while they narrow the gap.
void BalanceWithinRanks(Packing* p, int64_t* work) {
  if (p->m() < 2) return;
  for (int32_t r = 0; r < p->c->ranks; ++r) {
    int64_t units = 0;
    for (int64_t b = 0; b < p->m(); ++b) units += p->units(r, b);
    if (units < 2) continue;
    RepackRank(p, r);
    // A share of the work for each rank, so the last are balanced too.
    int64_t share = std::max<int64_t>(*work / (p->c->ranks - r), 4 * units);
    *work -= share;
    while (share > 0) {
      const auto& cost = p->cost[r];
      const int64_t hb =
          std::max_element(cost.begin(), cost.end()) - cost.begin();
      const int64_t lb =
          std::min_element(cost.begin(), cost.end()) - cost.begin();
      const double gap = cost[hb] - cost[lb];
      std::optional<Change> ch = BestChange(*p, {{r, hb}}, {{r, lb}}, gap,
                                            cost[hb] * kLeastGain, &share);
      if (!ch) break;
      Apply(*ch, p);
    }
  }
}

// Each rank's micro-batches by cost, largest first, into p, then emitted as
// reversed(p[0::2]) + p[1::2].
void PipelineOrder(Plan* plan) {
  const int64_t m = plan->micro_batches_per_rank;
  for (size_t start = 0; start < plan->micro_batches.size(); start += m) {
    const auto first = plan->micro_batches.begin() + start;
    std::vector<MicroBatch> p(std::make_move_iterator(first),
                              std::make_move_iterator(first + m));
    std::stable_sort(p.begin(), p.end(),
                     [](const MicroBatch& a, const MicroBatch& b) {
                       return a.cost > b.cost;
                     });
    std::vector<MicroBatch*> emitted;
    for (int64_t j = (m - 1) / 2 * 2; j >= 0; j -= 2) emitted.push_back(&p[j]);
    for (int64_t j = 1; j < m; j += 2) emitted.push_back(&p[j]);
    for (int64_t j = 0; j < m; ++j) *(first + j) = std::move(*emitted[j]);
  }
}

// Whether a is a better packing than b (same micro-batches per rank): a
// smaller largest rank cost, then fewer padded tokens on the fullest rank.
bool Better(const Packing& a, const Packing& b) {
  const double ca = a.MaxRankCost(), cb = b.MaxRankCost();
  if (std::abs(ca - cb) > 1e-12 * std::max(ca, cb)) return ca < cb;
  return *std::max_element(a.rank_fill.begin(), a.rank_fill.end()) <
         *std::max_element(b.rank_fill.begin(), b.rank_fill.end());
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
  PACKD_ASSIGN_OR_RETURN(const Checked c,
                         Validate(lengths, loss_tokens, options));
  int64_t oversize = 0;
  for (int64_t p : c.units.padded) oversize += p > c.budget;
  int64_t m =
      std::max(LowerBound(c),
               RoundUp(std::max<int64_t>(1, (oversize + c.ranks - 1) / c.ranks),
                       c.multiple));
  int64_t slots;
  if (options.max_micro_batches > 0 &&
      (__builtin_mul_overflow(m, int64_t{c.ranks}, &slots) ||
       slots > options.max_micro_batches)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the plan would hold at least ", m, " micro-batches on each of ",
        c.ranks, " ranks, more than max_micro_batches (",
        options.max_micro_batches,
        ") in all: raise max_tokens_per_micro_batch"));
  }
  // Candidates at the fewest micro-batches per rank any of them reaches:
  // the greedy packing by cost (or, where the cap is too tight for it, by
  // tokens), the Karmarkar-Karp partition by cost, first fit dealt by cost
  // (slime's plan), and ranks balanced by tokens split by cost (verl's); the
  // best is balanced by local search, across ranks, then within each.
  const std::vector<std::vector<int64_t>> partition =
      KarmarkarKarp(c.units.cost, AllUnits(c), c.ranks, /*equal_size=*/false);
  double mean_cost = 0;
  for (double v : c.units.cost) mean_cost += v;
  mean_cost /= c.ranks;
  // Orders and partitions the tries below share, made once (the last two
  // when first needed).
  const std::vector<int64_t> by_cost = Descending(c, /*by_cost=*/true);
  std::vector<int64_t> by_padded;
  std::vector<std::vector<int64_t>> by_tokens;
  std::vector<Packing> candidates;
  for (;; m += c.multiple) {
    Packing p(c, 0);
    if (Greedy(c, by_cost, m, /*by_cost=*/true, &p)) {
      candidates.push_back(std::move(p));
    } else {
      if (by_padded.empty()) by_padded = Descending(c, /*by_cost=*/false);
      if (Greedy(c, by_padded, m, /*by_cost=*/false, &p)) {
        candidates.push_back(std::move(p));
      }
    }
    if (Differenced(c, partition, m, &p)) candidates.push_back(std::move(p));
    // The other two only where those are not level already (large batches
    // are, and first fit is their slowest).
    const bool level = std::any_of(
        candidates.begin(), candidates.end(), [&](const Packing& q) {
          return q.MaxRankCost() <= mean_cost * (1 + 1e-7);
        });
    if (!level) {
      // First fit dealt by cost; ranks balanced by tokens, split by cost.
      if (auto batches = FirstFit(c, int64_t{c.ranks} * m)) {
        candidates.push_back(
            PackingOf(c, SplitAndDeal(c, *std::move(batches), m)));
      }
      if (by_tokens.empty()) by_tokens = RanksByTokens(c);
      if (std::optional<Bins> bins = SplitByCost(c, by_tokens, m)) {
        candidates.push_back(PackingOf(c, *bins));
      }
    }
    if (!candidates.empty()) break;
  }
  Packing* best = nullptr;
  for (Packing& p : candidates) {
    FillEmpty(&p);
    if (best == nullptr || Better(p, *best)) best = &p;
  }
  Packing chosen = std::move(*best);
  int64_t work = kSearchWork;
  BalanceRanks(&chosen, &work);
  work = kSearchWork / 2;
  BalanceWithinRanks(&chosen, &work);
  Plan plan = Assemble(chosen.bins, c, lengths, loss_tokens);
  if (options.pipeline_order) PipelineOrder(&plan);
  return plan;
}

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
  std::vector<int64_t> unit_of(lengths.size());
  for (int64_t u = 0; u < c->units.size(); ++u) {
    for (int64_t at = c->units.begin[u]; at < c->units.begin[u + 1]; ++at) {
      unit_of[c->units.samples[at]] = u;
    }
  }
  auto near = [](double a, double b) {
    return std::abs(a - b) <= 1e-9 * std::max({1.0, std::abs(a), std::abs(b)});
  };
  std::vector<int> seen(lengths.size(), 0);
  std::vector<int64_t> batch_of(c->units.size(), -1);
  std::vector<double> rank_cost(c->ranks, 0);
  int64_t loss = 0, empty = 0, sequences = 0;
  for (size_t j = 0; j < plan.micro_batches.size(); ++j) {
    const MicroBatch& mb = plan.micro_batches[j];
    if (mb.rank != static_cast<int32_t>(j / m)) {
      return broken("micro-batch ", j, " has rank ", mb.rank);
    }
    int64_t tokens = 0, mb_loss = 0, padded = 0, units = 0;
    double cost = 0;
    for (int64_t i : mb.samples) {
      if (i < 0 || i >= static_cast<int64_t>(lengths.size()) || seen[i]++) {
        return broken("sample ", i, " is out of range or placed twice");
      }
      const int64_t u = unit_of[i];
      if (batch_of[u] < 0) {
        batch_of[u] = static_cast<int64_t>(j);
        ++units;
      } else if (batch_of[u] != static_cast<int64_t>(j)) {
        return broken("the group of sample ", i,
                      " is split over micro-batches ", batch_of[u], " and ", j);
      }
      const int64_t sample_loss =
          loss_tokens.empty() ? lengths[i] : loss_tokens[i];
      tokens += lengths[i];
      mb_loss += sample_loss;
      padded += c->padded[i];
      cost += c->cost[i];
      sequences += sample_loss > 0;
    }
    if (tokens != mb.tokens || mb_loss != mb.loss_tokens ||
        padded != mb.padded_tokens || !near(cost, mb.cost)) {
      return broken("micro-batch ", j, " sums are wrong");
    }
    if (!KeepsCap(*c, padded, units)) {
      return broken("micro-batch ", j, " holds ", padded, " padded tokens in ",
                    units, " units, over the budget ", c->budget);
    }
    empty += mb.samples.empty();
    loss += mb_loss;
    rank_cost[mb.rank] += cost;
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != 1) return broken("sample ", i, " is not placed");
  }
  if (empty > 0 && c->units.size() >= slots) {
    return broken(empty, " empty micro-batches with ", c->units.size(),
                  " units for ", slots, " micro-batches");
  }
  if (loss != plan.global_loss_tokens) {
    return broken("global_loss_tokens ", plan.global_loss_tokens, " != ", loss);
  }
  if (sequences != plan.global_sequences) {
    return broken("global_sequences ", plan.global_sequences,
                  " != ", sequences);
  }
  double total = 0;
  for (double v : rank_cost) total += v;
  const double imbalance =
      total == 0 ? 1.0
                 : *std::max_element(rank_cost.begin(), rank_cost.end()) *
                       c->ranks / total;
  if (!near(imbalance, plan.cost_imbalance)) {
    return broken("cost_imbalance ", plan.cost_imbalance, " != ", imbalance);
  }
  if (options.pipeline_order) {
    for (int64_t start = 0; start < slots; start += m) {
      std::vector<double> p;
      for (int64_t j = start; j < start + m; ++j) {
        p.push_back(plan.micro_batches[j].cost);
      }
      std::sort(p.begin(), p.end(), std::greater<>());
      std::vector<double> expected;
      for (int64_t j = (m - 1) / 2 * 2; j >= 0; j -= 2)
        expected.push_back(p[j]);
      for (int64_t j = 1; j < m; j += 2) expected.push_back(p[j]);
      for (int64_t j = 0; j < m; ++j) {
        if (plan.micro_batches[start + j].cost != expected[j]) {
          return broken("rank ", start / m,
                        " is not in pipeline order at micro-batch ", j);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace packd
