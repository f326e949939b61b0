#include "planner/planner.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "planner/internal/local_search.h"
#include "planner/internal/packing.h"
#include "planner/internal/partition.h"
#include "planner/internal/units.h"

namespace packd {

void Plan::SetImbalance(int ranks) {
  std::vector<int64_t> tokens(std::max(ranks, 1), 0);
  std::vector<double> costs(tokens.size(), 0.0);
  for (const MicroBatch& m : micro_batches) {
    tokens[m.rank] += m.tokens;
    costs[m.rank] += m.cost;
  }
  const double R = static_cast<double>(tokens.size());
  const int64_t all_tokens =
      std::accumulate(tokens.begin(), tokens.end(), static_cast<int64_t>(0));
  const double all_cost = std::accumulate(costs.begin(), costs.end(), 0.0);
  imbalance = all_tokens > 0 ? static_cast<double>(*std::max_element(
                                   tokens.begin(), tokens.end())) *
                                   R / static_cast<double>(all_tokens)
                             : 1.0;
  cost_imbalance =
      all_cost > 0
          ? *std::max_element(costs.begin(), costs.end()) * R / all_cost
          : 1.0;
}
namespace {

using planner_internal::AllUnits;
using planner_internal::Assemble;
using planner_internal::BalanceRanks;
using planner_internal::BalanceWithinRanks;
using planner_internal::Better;
using planner_internal::Bins;
using planner_internal::Checked;
using planner_internal::Descending;
using planner_internal::Differenced;
using planner_internal::FillEmpty;
using planner_internal::FirstFit;
using planner_internal::Greedy;
using planner_internal::KarmarkarKarp;
using planner_internal::LowerBound;
using planner_internal::Packing;
using planner_internal::PackingOf;
using planner_internal::RanksByCost;
using planner_internal::RanksByTokens;
using planner_internal::RoundUp;
using planner_internal::SplitAndDeal;
using planner_internal::SplitByCost;
using planner_internal::Validate;

// The local search's work, in units compared: a few milliseconds here, and
// room for hundreds of changes on a batch of a thousand samples.
constexpr int64_t kSearchWork = 6'000'000;

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

}  // namespace

double SequenceCost(const PlanOptions& options, int64_t padded) {
  return SegmentCost(options, padded, padded);
}

double SegmentCost(const PlanOptions& options, int64_t queries, int64_t keys) {
  const double q = static_cast<double>(queries), k = static_cast<double>(keys);
  if (options.cost_per_token == 0 && options.cost_per_token_squared == 0) {
    return q;
  }
  return options.cost_per_token * q + options.cost_per_token_squared * q * k;
}

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
  // (slime's plan), and ranks balanced by tokens or by cost with equal counts,
  // split by cost (verl's); the best is balanced by local search, across
  // ranks, then within each.
  const std::vector<std::vector<int64_t>> partition =
      KarmarkarKarp(c.units.cost, AllUnits(c), c.ranks, /*equal_size=*/false);
  double mean_cost = 0;
  for (double v : c.units.cost) mean_cost += v;
  mean_cost /= c.ranks;
  // Orders and partitions the tries below share, made once (the last two
  // when first needed).
  const std::vector<int64_t> by_cost = Descending(c, /*by_cost=*/true);
  std::vector<int64_t> by_padded;
  std::vector<std::vector<int64_t>> by_tokens, by_rank_cost;
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
      // First fit dealt by cost; ranks balanced by tokens or by cost, split
      // by cost.
      if (auto batches = FirstFit(c, int64_t{c.ranks} * m)) {
        candidates.push_back(
            PackingOf(c, SplitAndDeal(c, *std::move(batches), m)));
      }
      if (by_tokens.empty()) by_tokens = RanksByTokens(c);
      if (std::optional<Bins> bins = SplitByCost(c, by_tokens, m)) {
        candidates.push_back(PackingOf(c, *bins));
      }
      if (by_rank_cost.empty()) by_rank_cost = RanksByCost(c);
      if (std::optional<Bins> bins = SplitByCost(c, by_rank_cost, m)) {
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

}  // namespace packd
