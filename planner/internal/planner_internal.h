// The planner's building blocks, shared with its peers (workloads/
// peer_planners.h, the plans packd is measured against) so that all validate,
// cost and partition alike. Not API: planner.h is.
//
//   PACKD_ASSIGN_OR_RETURN(Checked c, Validate(lengths, loss_tokens, options));
//   auto ranks = KarmarkarKarp(c.units.cost, AllUnits(c), c.ranks, false);
#ifndef PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_
#define PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/planner.h"

namespace packd::planner_internal {

// What the planner places: units, each a sample or all the samples of a
// group, ordered by their first sample.
struct Units {
  std::vector<int64_t> padded;  // padded tokens of each unit
  std::vector<double> cost;     // cost of each unit
  // Unit u's samples, ascending: samples[begin[u]] .. samples[begin[u + 1]].
  std::vector<int64_t> begin;
  std::vector<int64_t> samples;
  int64_t size() const { return static_cast<int64_t>(padded.size()); }
};

// Micro-batches of units of each rank: bins[rank][m].
using Bins = std::vector<std::vector<std::vector<int64_t>>>;

// A request, checked and normalised.
struct Checked {
  int32_t ranks = 1;
  int32_t multiple = 1;
  int64_t budget = 0;
  int64_t total = 0;  // sum of lengths
  // Sum of min(padded, budget) over units: a unit over the budget fills one
  // micro-batch, whatever its length.
  int64_t capped_total = 0;
  std::vector<int64_t> padded;  // of each sample
  std::vector<double> cost;     // of each sample
  Units units;
};

// The checked request, or INVALID_ARGUMENT as PlanMicroBatches documents.
absl::StatusOr<Checked> Validate(absl::Span<const int64_t> lengths,
                                 absl::Span<const int64_t> loss_tokens,
                                 const PlanOptions& options);

// n rounded up to a multiple of `to` (> 0).
int64_t RoundUp(int64_t n, int64_t to);

// MicroBatchLowerBound of a checked request.
int64_t LowerBound(const Checked& c);

// Whether a micro-batch of `count` units and `padded` tokens keeps the cap:
// within the budget, or one unit alone.
inline bool KeepsCap(const Checked& c, int64_t padded, size_t count) {
  return padded <= c.budget || count <= 1;
}

// The plan of `bins` (of units): samples ascending in each micro-batch, the
// sums, the imbalances and global counts.
Plan Assemble(const Bins& bins, const Checked& c,
              absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> loss_tokens);

// 0 .. c.units.size() - 1.
std::vector<int64_t> AllUnits(const Checked& c);

// The units' padded tokens, as values for KarmarkarKarp.
std::vector<double> PaddedValues(const Checked& c);

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

// The units over ranks balanced by padded tokens with Karmarkar-Karp, equal
// counts when they divide; SplitByCost then splits each rank by cost into m
// micro-batches with Karmarkar-Karp, nullopt when one breaks the cap. verl's
// plan, and a candidate of packd's.
std::vector<std::vector<int64_t>> RanksByTokens(const Checked& c);
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

#endif  // PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_
