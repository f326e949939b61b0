// The parts of a training step (docs/design.md §12) that need neither gRPC nor
// a device, as functions of plain values: the rows measured for the plan, the
// plan chosen within the message limit, and the micro-batches' tables (each
// result's rows, bytes and place in the outputs, from PackSizes). TrainingStep
// (service/step.h) runs them in order between decoding the batch and packing;
// the host step and the device pass share them.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(PackResult counted, Pack({loss_or_mask}, mask, host));
//   MeasuredRows measured = MeasureRows(counted, loss_dtype, documents, sizes, model);
//   PACKD_ASSIGN_OR_RETURN(Plan plan, PlanWithinMessage(measured.lengths, ...));
//   PACKD_ASSIGN_OR_RETURN(MicroBatchTables tables, PlaceMicroBatches(...));
// clang-format on
#ifndef PACKD_SERVICE_STEP_PARTS_H_
#define PACKD_SERVICE_STEP_PARTS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/layout_options.h"
#include "base/tensor_view.h"
#include "kernels/pack.h"
#include "kernels/pack_sizes.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/planner.h"

namespace packd {

// PlanMicroBatches within a server's message limit: plans that could not fit
// one response of `max_message_bytes` (each micro-batch slot costs at least 8
// bytes) are RESOURCE_EXHAUSTED saying so; the planner's other errors as they
// are.
absl::StatusOr<Plan> PlanWithinMessage(absl::Span<const int64_t> lengths,
                                       absl::Span<const int64_t> loss_tokens,
                                       PlanOptions options,
                                       int64_t max_message_bytes);

// The fields of a PackMicroBatches request that packd fills or refuses
// itself, checked before the batch is decoded: INVALID_ARGUMENT naming the
// field for plan.lengths, plan.loss_tokens or plan.costs given (packd measures
// every row), plan.pad_multiple (the batch's layout pads), a cost model that is
// negative or not finite, and batch.outputs (micro-batches come in the
// stream).
absl::Status CheckStepRequest(const v1::PackMicroBatchesRequest& request);

// The plan of a batch's measured rows (`measured`: the plan request with every
// row's length, cost and loss tokens) within the message limit: each row one
// sample, its loss tokens counted whole while its length is one CP or SP
// rank's share (so the planner's bound between them is off), a shared
// prefix's groups its units. Errors are PlanWithinMessage's, saying they come
// from planning the batch's rows.
absl::StatusOr<Plan> PlanStepRows(const v1::PlanRequest& measured,
                                  const LayoutOptions& layout,
                                  int64_t max_message_bytes);

// What a step learns of one row of its batch. Plain values.
struct MeasuredRow {
  // Its sequences' real lengths: its documents with segment ids, else itself.
  std::vector<int64_t> sequences;
  // With a shared prefix: its targets, keys and segments in the stream.
  int64_t targets = 0;
  int64_t keys = 0;
  int64_t segments = 0;
};

// The rows of a batch as the planner takes them, one entry per row. Plain
// values.
struct MeasuredRows {
  std::vector<MeasuredRow> rows;
  // One CP or SP rank's rows of it: its sequences padded (PackSizes), summed,
  // then shared out (PackSizes::RankRows).
  std::vector<int64_t> lengths;
  // The cost model summed over its padded sequences (attention runs over each
  // on its own).
  std::vector<double> costs;
  // Its positions active in the mask and in the loss mask, on every rank.
  std::vector<int64_t> loss_tokens;
  // One past its last active position (the host gathers no further).
  std::vector<int64_t> extents;
};

// The rows of a batch without shared prompts, from `counted`: the host Pack of
// the loss mask (of the mask when `loss` is empty; `loss` is then the loss
// mask's dtype) under the mask, with the segment ids when `documents`.
MeasuredRows MeasureRows(const PackResult& counted, std::optional<DType> loss,
                         bool documents, const PackSizes& sizes,
                         const PlanOptions& model);

// The rows of a batch whose rows share prompts (docs/design.md §14), from
// `counted` as for MeasureRows: each group's stream laid out with `layout`
// (its max_rows aside: the whole batch's stream is never sent), each row
// costing its segments' queries and keys (a prompt's on its group's first
// row), its loss tokens its targets (active positions from max(prefix, 1))
// active in the loss mask. The layout's errors for prompts outside their
// rows.
absl::StatusOr<MeasuredRows> MeasureSharedRows(const PackResult& counted,
                                               std::optional<DType> loss,
                                               const LayoutOptions& layout,
                                               const PlanOptions& model);

// Where one micro-batch sent by a step goes. Plain values; `micro_batch`
// points into the step's plan.
struct MicroBatchPlace {
  const v1::MicroBatch* micro_batch = nullptr;
  int index = 0;  // its position in its rank
  // Each result's rows, bytes and offset in the outputs (the inputs', then
  // the shifts'), each offset a multiple of 64.
  std::vector<int64_t> rows, bytes, offsets;
};

// The micro-batches a step sends and what they take. Plain values.
struct MicroBatchTables {
  std::vector<MicroBatchPlace> sent;
  // The bytes of every result sent, placed one after another.
  int64_t output_bytes = 0;
  // The most one micro-batch makes the server hold: its rows gathered in
  // host memory, then its message.
  int64_t max_micro_batch_bytes = 0;
};

// The micro-batches of `plan` that the ranks `ranks` (all when empty) are
// sent, in plan order, each checked against the layout and the message limit
// and placed in the outputs. `rows` are the batch's rows measured; `inputs`
// its tensors' headers ([B, S, *tail]); `gather` what a micro-batch's rows
// take gathered in host memory.
// INVALID_ARGUMENT for a rank outside 0 .. num_ranks - 1 or repeated, and the
// layout's errors for a micro-batch (a `fixed` it does not fit), naming it;
// RESOURCE_EXHAUSTED for a micro-batch whose message would pass
// `max_message_bytes`.
absl::StatusOr<MicroBatchTables> PlaceMicroBatches(
    const v1::PlanResponse& plan, absl::Span<const int32_t> ranks,
    int32_t num_ranks, const std::vector<MeasuredRow>& rows,
    const LayoutOptions& layout, const PackSizes& sizes,
    absl::Span<const TensorView> inputs, const HostGather& gather,
    int64_t max_message_bytes);

}  // namespace packd

#endif  // PACKD_SERVICE_STEP_PARTS_H_
