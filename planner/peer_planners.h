// The peers packd's planner is measured against in C++ (bench_plan, packctl
// plan, planner_test's slime): micro-batches planned as verl and as slime plan
// them, transcribed from their code, on the same units (a sample or a group),
// padded lengths and costs as packd's planner. tests/python/test_verl.py
// compares packd with verl's own functions instead.
//
// clang-format off
//   absl::StatusOr<Plan> verl = PlanMicroBatchesLikeVerl(lengths, {}, options);
//   absl::StatusOr<Plan> slime = PlanMicroBatchesLikeSlime(lengths, {}, options);
// clang-format on
#ifndef PACKD_PLANNER_PEER_PLANNERS_H_
#define PACKD_PLANNER_PEER_PLANNERS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/planner.h"

namespace packd {

// verl (verl/utils/seqlen_balancing.py's Karmarkar-Karp and
// rearrange_micro_batches): units balanced over ranks by padded tokens with
// Karmarkar-Karp (equal counts when they divide); then per rank ceil(tokens /
// budget) micro-batches (the maximum over ranks, rounded up to the multiple),
// split by cost with Karmarkar-Karp, one more while any micro-batch of several
// units holds more than the budget. verl 0.9.1's trainer balances its ranks by
// its workload instead, where the units divide by the ranks (it refuses other
// counts); tests/python/test_verl.py measures packd against that, verl's own
// code. The errors of PlanMicroBatches; pipeline_order is not applied.
absl::StatusOr<Plan> PlanMicroBatchesLikeVerl(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options);

// slime (a transcription: slime is not on PyPI): units first fit, in their
// order, into micro-batches of the budget; the largest micro-batch of several
// units split in two (Karmarkar-Karp by tokens) until their count is a multiple
// of ranks x micro_batch_multiple (an empty one added when none can be split);
// then the micro-batches dealt to ranks in equal counts, balanced by cost with
// Karmarkar-Karp. The errors of PlanMicroBatches; pipeline_order is not
// applied.
absl::StatusOr<Plan> PlanMicroBatchesLikeSlime(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options);

}  // namespace packd

#endif  // PACKD_PLANNER_PEER_PLANNERS_H_
