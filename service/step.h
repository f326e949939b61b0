// TrainingStep: the work of a PackMicroBatches call (docs/design.md §12),
// without gRPC. The batch is decoded once; each row is measured as the layout
// lays it out (its length: the rows its sequences take, padded, on one CP or
// SP rank; its cost: the cost model summed over its sequences, which
// attention runs over separately; its loss tokens: positions active in the
// mask and in loss_mask, on every rank); the rows are planned into
// micro-batches (planner/planner.h); and each micro-batch is packed on its
// own, exactly as Pack packs its rows gathered in plan order, with the
// batch's options. Its parts, each tested on its own: StepBatch (the batch
// decoded, on the host where it is planned), the pure parts of step_parts.h
// (the rows measured, the plan within the message limit, the micro-batches'
// tables) and DevicePass (a batch on a GPU packed in one pass).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto step, TrainingStep::Make(request, decoder, limit, tenant));
//   send(step->plan());
//   for (size_t k = 0; k < step->size(); ++k) step->PackMicroBatch(k, &reply, &buffers);
// clang-format on
#ifndef PACKD_SERVICE_STEP_H_
#define PACKD_SERVICE_STEP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/buffer.h"
#include "kernels/mrope.h"
#include "kernels/pack.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/planner.h"
#include "proto/wire.h"
#include "service/call_spec.h"
#include "service/device_pass.h"
#include "service/request_decoder.h"
#include "service/step_batch.h"
#include "service/step_parts.h"

namespace packd {

// Not safe to share while Make runs; once made, PackMicroBatch may be called
// from several threads at once.
class TrainingStep {
 public:
  // Decodes and checks `request` (which must outlive the step), measures its
  // rows and plans them. Errors: Pack's and Plan's; INVALID_ARGUMENT for batch
  // outputs, for plan fields packd measures itself (lengths, loss_tokens,
  // costs, pad_multiple), a negative cost model, a loss_mask not of the mask's
  // shape, ranks outside the plan or repeated, and a micro-batch that `fixed`
  // does not hold; RESOURCE_EXHAUSTED for a micro-batch whose message would
  // pass `max_message_bytes`; outputs that overlap the batch's tensors, and
  // batch tensors or outputs in a device region on another device than the
  // step's (batch.device). Tensors in device regions are read on their
  // device: the mask, segment ids and loss mask copied to the host to be
  // measured, each micro-batch's input rows gathered on the device
  // (DeviceRuntime::CopyRows) and packed there; the device's errors are
  // Pack's (FAILED_PRECONDITION when it is missing, UNAVAILABLE once lost).
  // The regions it names are `tenant`'s.
  static absl::StatusOr<std::unique_ptr<TrainingStep>> Make(
      const Wire<v1::PackMicroBatchesRequest>& request,
      const RequestDecoder& decoder, int64_t max_message_bytes,
      const Tenant& tenant);

  // The rows of a batch already decoded (`call`, in host memory, with its
  // `loss_mask` when given) measured as Make measures them, without a plan
  // and without copying a tensor (`call` keeps its regions mapped): the plan
  // request `plan` (its cost model) with every row's length, cost and loss
  // tokens. `headers`: the batch's PackRequest, its layout and tensor headers
  // (their bytes are not read). Make's errors for the batch's layout and rows.
  // What a streaming step learns of each group.
  static absl::StatusOr<v1::PlanRequest> MeasureDecoded(
      const v1::PackRequest& headers, const DecodedCall& call,
      std::optional<TensorView> loss_mask, const v1::PlanRequest& plan,
      int64_t max_message_bytes, const Tenant& tenant);

  const v1::PlanResponse& plan() const { return plan_; }
  // The plan request with every row's measured length, cost and loss tokens.
  const v1::PlanRequest& measured() const { return measured_; }
  // Where the micro-batches are packed.
  const Device& device() const { return batch_->device(); }
  // The micro-batches sent (those of the ranks asked), in order.
  size_t size() const { return sent_.size(); }
  // The most bytes one micro-batch makes the server hold while it is packed
  // and sent: its rows gathered, then its results.
  int64_t max_micro_batch_bytes() const { return max_micro_batch_bytes_; }
  // The most bytes the server holds for the step at once: two micro-batches
  // (the one being sent and the next), and with the device pass and no
  // outputs every micro-batch's results, read back in one copy.
  int64_t held_bytes() const;
  // The bytes the results of every micro-batch sent take in the request's
  // outputs, each tensor from a multiple of 64 (the first message says it).
  int64_t output_bytes() const { return output_bytes_; }
  // Packs sent micro-batch k into `response` (rank, index, samples, packed),
  // its results in pooled buffers that `buffers` keeps, carried by the
  // response without a copy. Safe to call from several threads at once.
  absl::Status PackMicroBatch(size_t k,
                              Wire<v1::PackMicroBatchesResponse>* response,
                              std::vector<Buffer>* buffers) const;
  // Where Make's time went: the batch decoded, its device tensors brought to
  // the host and its rows measured; the plan made and checked.
  struct Phases {
    absl::Duration measure, plan;
  };
  const Phases& phases() const { return phases_; }
  // The device pass's time once it has run (zero before, and without one).
  absl::Duration device_time() const;
  // The call's messages: the plan, then one per micro-batch sent.
  size_t messages() const { return size() + 1; }
  // Message k into `response`: 0 the plan with output_bytes, k > 0 sent
  // micro-batch k - 1 (PackMicroBatch). What every driver of a step sends.
  absl::Status Message(size_t k, Wire<v1::PackMicroBatchesResponse>* response,
                       std::vector<Buffer>* buffers) const;

 private:
  TrainingStep(const v1::PackRequest& batch, int64_t max_message_bytes,
               const Tenant& tenant)
      : max_message_bytes_(max_message_bytes),
        spec_(CallSpec::Of(batch, "batch.", max_message_bytes, tenant)) {}
  // After the batch is decoded into batch_: its layout checked, its rows
  // measured into `plan` (Measure) and its inputs' shapes checked.
  absl::Status MeasureBatch(v1::PlanRequest* plan,
                            std::vector<MeasuredRow>* rows);
  // The layout Pack would refuse for the batch, before anything is planned;
  // otherwise its pad values and fills.
  absl::StatusOr<LayoutValues> CheckBatchLayout(
      const v1::PlanRequest& plan) const;
  // Measures the rows and fills the plan request's lengths, loss tokens and
  // costs; `rows` gets what it learns of each.
  absl::Status Measure(v1::PlanRequest* plan, std::vector<MeasuredRow>* rows);
  // With batch.mrope: checks the batch's grids against its token ids and
  // counts each row's (mrope_rows_), on the host, with `measure`'s options.
  absl::Status MeasureGrids(PackOptions measure);
  // With batch.shared_prefix: the prompts that must agree compared over the
  // whole batch, on the host (`cu_seqlens`: the mask's rows packed).
  absl::Status CheckSamePrompts(const std::vector<int64_t>& cu_seqlens);
  // Chooses the micro-batches sent, checks each against the layout and the
  // message limit, and places its results in the outputs.
  absl::Status Choose(const v1::PackMicroBatchesRequest& request,
                      const std::vector<MeasuredRow>& rows);

  const int64_t max_message_bytes_;
  // The batch's headers, layout and sizes, decoded once; each micro-batch's
  // spec is derived from it (CallSpec::OfRows).
  const CallSpec spec_;
  std::unique_ptr<StepBatch> batch_;
  // The layout's pad values and fills, checked once (the device pass writes
  // them).
  LayoutValues values_;
  // Per row: one past its last active position.
  std::vector<int64_t> extents_;
  // With batch.mrope: the grids and videos of each row (prefix arrays), so
  // that each micro-batch gets its rows' grids.
  GridsByRow mrope_rows_;
  // The plan request with every row's measured length, cost and loss tokens.
  v1::PlanRequest measured_;
  v1::PlanResponse plan_;
  std::vector<MicroBatchPlace> sent_;
  int64_t max_micro_batch_bytes_ = 0;
  int64_t output_bytes_ = 0;
  // The request's outputs, when the results are written there.
  std::optional<ResolvedSlice> outputs_;
  v1::RegionSlice outputs_slice_;
  // With a batch on a GPU that the pass takes (DevicePass::Applies).
  std::optional<DevicePass> pass_;
  Phases phases_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_STEP_H_
