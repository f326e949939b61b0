// The planner's units and the checked request (docs/design.md §9, §11): a
// request validated and normalised once (each sample's padded length and
// cost, the samples of a group made one unit), the lower bound on the
// micro-batches per rank, and the Plan assembled from micro-batches of units.
// Shared with the peer planners (planner/peer_planners.h), so that all
// validate, cost and assemble alike. Not API: planner.h is.
//
//   PACKD_ASSIGN_OR_RETURN(Checked c, Validate(lengths, loss_tokens, options));
//   Plan plan = Assemble(bins, c, lengths, loss_tokens);
#ifndef PACKD_PLANNER_INTERNAL_UNITS_H_
#define PACKD_PLANNER_INTERNAL_UNITS_H_

#include <cstdint>
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

}  // namespace packd::planner_internal

#endif  // PACKD_PLANNER_INTERNAL_UNITS_H_
