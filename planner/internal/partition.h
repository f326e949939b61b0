// Candidate packings of the planner's units (docs/operation.md, "Micro-batch
// planning"): Karmarkar-Karp partitions, first fit, and the constructions of
// slime's and verl's planners, which packd tries among its candidates and
// measures itself against (planner/peer_planners.h). Not API: planner.h is.
//
//   auto ranks = KarmarkarKarp(c.units.cost, AllUnits(c), c.ranks, false);
//   if (auto batches = FirstFit(c, slots)) bins = SplitAndDeal(c, *batches, m);
#ifndef PACKD_PLANNER_INTERNAL_PARTITION_H_
#define PACKD_PLANNER_INTERNAL_PARTITION_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "planner/internal/units.h"

namespace packd::planner_internal {

// The units first fit, in their order, into at most `slots` micro-batches
// of the budget (a unit over it alone); nullopt when they need more. Log
// time per unit: the first micro-batch with room is found in a tree of the
// rooms left.
std::optional<std::vector<std::vector<int64_t>>> FirstFit(const Checked& c,
                                                          int64_t slots);

// `batches` made ranks x m: the fullest of several units split in two
// (Karmarkar-Karp by tokens) while there are fewer, empty ones added when
// none can be split; then dealt to the ranks m each, balanced by cost with
// Karmarkar-Karp (equal counts). slime's plan, and a candidate of packd's.
Bins SplitAndDeal(const Checked& c, std::vector<std::vector<int64_t>> batches,
                  int64_t m);

// The units over ranks balanced with Karmarkar-Karp, equal counts when they
// divide: by padded tokens, or by cost (as verl 0.9's trainer balances its
// ranks, by its workload: verl/trainer/ppo/ray_trainer.py, _balance_batch);
// SplitByCost then splits each rank by cost into m micro-batches with
// Karmarkar-Karp, nullopt when one breaks the cap (verl's
// rearrange_micro_batches). verl's plan, and two candidates of packd's.
std::vector<std::vector<int64_t>> RanksByTokens(const Checked& c);
std::vector<std::vector<int64_t>> RanksByCost(const Checked& c);
std::optional<Bins> SplitByCost(const Checked& c,
                                const std::vector<std::vector<int64_t>>& ranks,
                                int64_t m);

// Karmarkar-Karp (largest differencing) k-way partition of `items` by
// value[item], as verl's get_seqlen_balanced_partitions does it: items sorted
// ascending; each partial solution is k sets, heaviest first; the two with
// the largest spread are merged, the heaviest set of one with the lightest of
// the other. With equal_size, items enter in sorted groups of k, so every set
// gets the same count. Partial solutions keep only their non-empty sets and
// sets are linked lists, so a merge costs the sets it touches: about
// n log k in all.
std::vector<std::vector<int64_t>> KarmarkarKarp(
    absl::Span<const double> value, const std::vector<int64_t>& items,
    int64_t k, bool equal_size);

}  // namespace packd::planner_internal

#endif  // PACKD_PLANNER_INTERNAL_PARTITION_H_
