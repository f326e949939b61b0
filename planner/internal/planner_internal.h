// The planner's building blocks, shared with its peer (workloads/
// verl_planner.h, the plan packd is measured against) so that both validate
// and partition alike. Not API: planner.h is.
//
//   PACKD_ASSIGN_OR_RETURN(Checked c, Validate(lengths, loss_tokens, options));
//   auto ranks = KarmarkarKarp(lengths, all, c.ranks, /*equal_size=*/true);
#ifndef PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_
#define PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/planner.h"

namespace packd::planner_internal {

// Samples of each micro-batch of each rank: bins[rank][m].
using Bins = std::vector<std::vector<std::vector<int64_t>>>;

// A request's options, checked and normalised.
struct Checked {
  int32_t ranks = 1;
  int32_t multiple = 1;
  int64_t budget = 0;
  int64_t total = 0;
  // Sum of min(length, budget): a sample over the budget fills one
  // micro-batch, whatever its length.
  int64_t capped_total = 0;
};

// The checked options, or INVALID_ARGUMENT as PlanMicroBatches documents.
absl::StatusOr<Checked> Validate(absl::Span<const int64_t> lengths,
                                 absl::Span<const int64_t> loss_tokens,
                                 const PlanOptions& options);

// n rounded up to a multiple of `to` (> 0).
int64_t RoundUp(int64_t n, int64_t to);

// The plan of `bins`: samples sorted, sums, loss tokens, imbalance.
Plan Assemble(Bins bins, absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> loss_tokens);

// Karmarkar-Karp (largest differencing) k-way partition of `items`, as verl's
// get_seqlen_balanced_partitions does it: each partial solution is k sets,
// sorted by sum, heaviest first; the two with the largest spread are merged,
// the heaviest set of one with the lightest of the other. With equal_size,
// items enter in sorted groups of k, so every set gets the same count.
std::vector<std::vector<int64_t>> KarmarkarKarp(
    absl::Span<const int64_t> lengths, const std::vector<int64_t>& items,
    int64_t k, bool equal_size);

}  // namespace packd::planner_internal

#endif  // PACKD_PLANNER_INTERNAL_PLANNER_INTERNAL_H_
