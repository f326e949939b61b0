#include "planner/stream_planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"

namespace packd {
namespace {

// A unit into a micro-batch: its id, its (padded) tokens, loss tokens and cost.
void AddUnit(const StreamUnit& u, MicroBatch* m) {
  m->samples.push_back(u.id);
  m->tokens += u.length;
  m->padded_tokens += u.length;
  m->loss_tokens += u.loss_tokens;
  m->cost += u.cost;
}

}  // namespace

absl::StatusOr<StreamPlanner> StreamPlanner::Make(const Options& options) {
  const PlanOptions& plan = options.plan;
  if (plan.max_tokens_per_micro_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens_per_micro_batch is ",
                     plan.max_tokens_per_micro_batch, "; it must be > 0"));
  }
  if (plan.num_ranks < 0 || plan.micro_batch_multiple < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_ranks (", plan.num_ranks, ") and micro_batch_multiple (",
        plan.micro_batch_multiple, ") must be >= 0"));
  }
  if (!(options.reserve >= 0 && options.reserve <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a streamed plan's reserve is ", options.reserve,
                     " micro-batches per rank; it must be in [0, 1e6]"));
  }
  if (!(options.fill > 0 && options.fill <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a wave's fill is ", options.fill, "; it must be in (0, 1]"));
  }
  if (!plan.costs.empty() || !plan.groups.empty() || plan.pad_multiple > 1 ||
      plan.pipeline_order) {
    return absl::InvalidArgumentError(
        "a streamed plan takes no costs, groups, pad_multiple or "
        "pipeline_order: its units come padded, with their costs, and are "
        "never split; pipeline order needs the whole batch");
  }
  StreamPlanner planner(options);
  planner.rank_costs_.assign(planner.ranks(), 0.0);
  planner.committed_.resize(planner.ranks());
  return planner;
}

absl::StatusOr<std::vector<Wave>> StreamPlanner::Add(const StreamUnit& unit) {
  if (closed_) {
    return absl::InvalidArgumentError("the streamed plan is closed");
  }
  if (unit.length < 0 || unit.loss_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit ", unit.id, " has length ", unit.length, " and loss tokens ",
        unit.loss_tokens, "; both must be >= 0"));
  }
  if (!std::isfinite(unit.cost) || unit.cost < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit.id, " costs ", unit.cost,
                     "; it must be finite and >= 0"));
  }
  if (!ids_.insert(unit.id).second) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit.id, " was added already"));
  }
  pool_.push_back(unit);
  loss_tokens_ += unit.loss_tokens;
  std::vector<Wave> waves;
  Wave wave;
  while (TryWave(&wave)) waves.push_back(std::move(wave));
  return waves;
}

bool StreamPlanner::TryWave(Wave* wave) {
  const int32_t R = ranks();
  const int64_t budget = options_.plan.max_tokens_per_micro_batch;
  const double floor = options_.fill * static_cast<double>(budget);
  // Ranks behind the costliest so far must each be filled; a wave needs at
  // least their tokens.
  const double most = *std::max_element(rank_costs_.begin(), rank_costs_.end());
  int64_t behind = 0;
  for (double c : rank_costs_) behind += c < most;
  int64_t total = 0;
  for (const StreamUnit& u : pool_) total += std::min(u.length, budget);
  const double reserve = options_.reserve * floor * R;
  if (static_cast<double>(total) <
      floor * std::max<int64_t>(behind, 1) + reserve) {
    return false;
  }
  std::vector<MicroBatch> bins;
  std::vector<char> taken;
  WaterFill(&bins, &taken);
  auto total_cost = [&](int r) { return rank_costs_[r] + bins[r].cost; };
  // Committed when every rank is filled, or already costs as much as the
  // least costly filled one: more for it now would only unbalance the step.
  double least_filled = -1;
  for (int r = 0; r < R; ++r) {
    if (static_cast<double>(bins[r].padded_tokens) >= floor &&
        (least_filled < 0 || total_cost(r) < least_filled)) {
      least_filled = total_cost(r);
    }
  }
  if (least_filled < 0) return false;
  for (int r = 0; r < R; ++r) {
    if (static_cast<double>(bins[r].padded_tokens) < floor &&
        total_cost(r) < least_filled) {
      return false;
    }
  }
  int64_t kept = 0;
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (!taken[i]) kept += pool_[i].length;
  }
  if (static_cast<double>(kept) < reserve) return false;
  Commit(&bins, taken, wave);
  return true;
}

bool StreamPlanner::CommitUnderFilled(Wave* wave) {
  if (closed_ || pool_.empty()) return false;
  std::vector<MicroBatch> bins;
  std::vector<char> taken;
  WaterFill(&bins, &taken);
  Commit(&bins, taken, wave);
  return true;
}

void StreamPlanner::WaterFill(std::vector<MicroBatch>* bins,
                              std::vector<char>* taken) const {
  const int32_t R = ranks();
  const int64_t budget = options_.plan.max_tokens_per_micro_batch;
  // Largest first, each into the micro-batch of the rank whose cost would be
  // least with it (a unit over the budget only into an empty one), water-
  // filling the ranks' costs under the budget.
  std::vector<size_t> order(pool_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return pool_[a].length > pool_[b].length;
  });
  bins->assign(R, MicroBatch{});
  taken->assign(pool_.size(), 0);
  auto total_cost = [&](int r) { return rank_costs_[r] + (*bins)[r].cost; };
  for (size_t i : order) {
    const StreamUnit& u = pool_[i];
    int best = -1;
    for (int r = 0; r < R; ++r) {
      const bool fits = (*bins)[r].padded_tokens + u.length <= budget ||
                        (*bins)[r].samples.empty();
      if (fits && (best < 0 || total_cost(r) < total_cost(best))) best = r;
    }
    if (best < 0) continue;
    AddUnit(u, &(*bins)[best]);
    (*taken)[i] = 1;
  }
}

void StreamPlanner::Commit(std::vector<MicroBatch>* bins,
                           const std::vector<char>& taken, Wave* wave) {
  const int32_t R = ranks();
  std::vector<StreamUnit> rest;
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (!taken[i]) rest.push_back(pool_[i]);
  }
  pool_ = std::move(rest);
  wave->micro_batches.assign(R, MicroBatch{});
  for (int r = 0; r < R; ++r) {
    MicroBatch& b = (*bins)[r];
    std::sort(b.samples.begin(), b.samples.end());
    b.rank = r;
    rank_costs_[r] += b.cost;
    committed_[r].push_back(b);
    wave->micro_batches[r] = std::move(b);
  }
  ++waves_;
}

Plan StreamPlanner::plan() const {
  Plan plan;
  plan.micro_batches_per_rank = waves_;
  plan.global_loss_tokens = loss_tokens_;
  for (const std::vector<MicroBatch>& rank : committed_) {
    plan.micro_batches.insert(plan.micro_batches.end(), rank.begin(),
                              rank.end());
  }
  plan.SetImbalance(static_cast<int>(committed_.size()));
  return plan;
}

absl::StatusOr<std::vector<Wave>> StreamPlanner::Close() {
  if (closed_) {
    return absl::InvalidArgumentError("the streamed plan is closed already");
  }
  closed_ = true;
  const int32_t R = ranks();
  const int64_t budget = options_.plan.max_tokens_per_micro_batch;
  // The fewest micro-batches per rank the whole-batch planner finds for the
  // rest: the rest fills that many, or one more per try.
  int64_t m = 0;
  if (!pool_.empty()) {
    std::vector<int64_t> lengths, loss;
    std::vector<double> costs;
    for (const StreamUnit& u : pool_) {
      lengths.push_back(u.length);
      loss.push_back(u.loss_tokens);
      costs.push_back(u.cost);
    }
    PlanOptions options = options_.plan;
    options.num_ranks = R;
    options.micro_batch_multiple = 1;
    options.costs = costs;
    options.loss_tokens_within_lengths = false;
    absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, loss, options);
    if (!plan.ok()) return plan.status();
    m = plan->micro_batches_per_rank;
  }
  // Costliest first, each to the rank that would cost least with it, in the
  // first of its m micro-batches it fits (a unit over the budget only into
  // an empty one): the rest balanced against what each rank has had.
  std::vector<size_t> order(pool_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return pool_[a].cost > pool_[b].cost || (pool_[a].cost == pool_[b].cost &&
                                             pool_[a].length > pool_[b].length);
  });
  std::vector<std::vector<MicroBatch>> lists;
  for (;; ++m) {
    lists.assign(R, std::vector<MicroBatch>(m));
    std::vector<double> costs = rank_costs_;
    bool placed_all = true;
    for (size_t i : order) {
      const StreamUnit& u = pool_[i];
      int best = -1, best_bin = -1;
      for (int r = 0; r < R; ++r) {
        if (best >= 0 && costs[r] >= costs[best]) continue;
        for (int64_t j = 0; j < m; ++j) {
          const MicroBatch& b = lists[r][j];
          if (b.padded_tokens + u.length <= budget || b.samples.empty()) {
            best = r;
            best_bin = static_cast<int>(j);
            break;
          }
        }
      }
      if (best < 0) {
        placed_all = false;
        break;
      }
      AddUnit(u, &lists[best][best_bin]);
      costs[best] += u.cost;
    }
    if (placed_all) {
      rank_costs_ = costs;
      break;
    }
  }
  const int64_t multiple =
      std::max<int32_t>(options_.plan.micro_batch_multiple, 1);
  const int64_t total = waves_ + m;
  const int64_t padded = (total + multiple - 1) / multiple * multiple;
  std::vector<Wave> waves(padded - waves_);
  for (Wave& w : waves) {
    w.micro_batches.assign(R, MicroBatch{});
    for (int32_t r = 0; r < R; ++r) w.micro_batches[r].rank = r;
  }
  for (int32_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < m; ++j) {
      MicroBatch& b = lists[r][j];
      std::sort(b.samples.begin(), b.samples.end());
      b.rank = r;
      waves[j].micro_batches[r] = std::move(b);
    }
  }
  for (const Wave& w : waves) {
    for (int32_t r = 0; r < R; ++r) committed_[r].push_back(w.micro_batches[r]);
  }
  pool_.clear();
  waves_ = padded;
  return waves;
}

}  // namespace packd
