// The peer packd's planner is measured against (bench_plan, packctl plan,
// planner_test): micro-batches planned as verl plans them.
//
//   absl::StatusOr<Plan> peer = PlanMicroBatchesLikeVerl(lengths, {}, options);
#ifndef PACKD_WORKLOADS_VERL_PLANNER_H_
#define PACKD_WORKLOADS_VERL_PLANNER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/planner.h"

namespace packd {

// Samples balanced over ranks with Karmarkar-Karp (equal counts when they
// divide), then per rank ceil(tokens / budget) micro-batches (the maximum over
// ranks, rounded up to the multiple), split with Karmarkar-Karp, one more
// while any micro-batch of several samples holds more than the budget. The
// errors of PlanMicroBatches.
absl::StatusOr<Plan> PlanMicroBatchesLikeVerl(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options);

}  // namespace packd

#endif  // PACKD_WORKLOADS_VERL_PLANNER_H_
