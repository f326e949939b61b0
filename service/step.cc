#include "service/step.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "kernels/pack_sizes.h"
#include "kernels/shared_prefix.h"
#include "proto/plan_codec.h"
#include "service/pack_reply.h"

namespace packd {

absl::StatusOr<std::unique_ptr<TrainingStep>> TrainingStep::Make(
    const Wire<v1::PackMicroBatchesRequest>& request,
    const RequestDecoder& decoder, int64_t max_message_bytes,
    const Tenant& tenant) {
  const absl::Time start = absl::Now();
  const v1::PackMicroBatchesRequest& message = request.message();
  PACKD_RETURN_IF_ERROR(CheckStepRequest(message));
  auto step = std::unique_ptr<TrainingStep>(
      new TrainingStep(message.batch(), max_message_bytes, tenant));
  PACKD_ASSIGN_OR_RETURN(step->batch_,
                         StepBatch::Make(request, decoder, step->spec_));
  v1::PlanRequest filled = message.plan();
  std::vector<MeasuredRow> rows;
  PACKD_RETURN_IF_ERROR(step->MeasureBatch(&filled, &rows));
  step->measured_ = filled;
  const absl::Time measured = absl::Now();
  step->phases_.measure = measured - start;
  PACKD_ASSIGN_OR_RETURN(
      const Plan planned,
      PlanStepRows(filled, step->spec_.layout, max_message_bytes));
  EncodePlan(planned, &step->plan_);
  PACKD_RETURN_IF_ERROR(
      decoder.CheckSize("plan message", step->plan_.ByteSizeLong()));
  PACKD_RETURN_IF_ERROR(step->Choose(message, rows));
  if (message.has_outputs()) {
    PACKD_ASSIGN_OR_RETURN(
        ResolvedSlice outputs,
        step->batch_->ResolveOutputs(message.outputs(), decoder, tenant));
    // Too small: the results come inline (a client keeps the last step's
    // output_bytes and has room from the next step of its shape on).
    if (static_cast<int64_t>(outputs.byte_size) >= step->output_bytes_) {
      step->outputs_ = std::move(outputs);
      step->outputs_slice_ = message.outputs();
    }
  }
  const ResolvedSlice* outputs =
      step->outputs_.has_value() ? &*step->outputs_ : nullptr;
  if (DevicePass::Applies(*step->batch_, step->spec_, outputs,
                          step->output_bytes_)) {
    step->pass_.emplace(*step->batch_, step->spec_, step->values_, step->sent_,
                        outputs != nullptr ? outputs->data : nullptr,
                        step->output_bytes_);
  }
  step->phases_.plan = absl::Now() - measured;
  return step;
}

absl::StatusOr<v1::PlanRequest> TrainingStep::MeasureDecoded(
    const v1::PackRequest& headers, const DecodedCall& call,
    std::optional<TensorView> loss_mask, const v1::PlanRequest& plan,
    int64_t max_message_bytes, const Tenant& tenant) {
  auto step = std::unique_ptr<TrainingStep>(
      new TrainingStep(headers, max_message_bytes, tenant));
  DecodedCall views;  // the caller's call holds what they view
  views.device = call.device;
  views.mask = call.mask;
  views.tensors = call.tensors;
  views.segment_ids = call.segment_ids;
  views.tenant = call.tenant;
  PACKD_ASSIGN_OR_RETURN(step->batch_,
                         StepBatch::Of(std::move(views), std::move(loss_mask)));
  v1::PlanRequest filled = plan;
  std::vector<MeasuredRow> rows;
  PACKD_RETURN_IF_ERROR(step->MeasureBatch(&filled, &rows));
  return filled;
}

absl::Status TrainingStep::MeasureBatch(v1::PlanRequest* plan,
                                        std::vector<MeasuredRow>* rows) {
  PACKD_ASSIGN_OR_RETURN(values_, CheckBatchLayout(*plan));
  PACKD_RETURN_IF_ERROR(Measure(plan, rows));
  // The mask is valid now (Measure packed it); the inputs' rows are gathered
  // per micro-batch before any Pack sees them, so their shapes are checked
  // here.
  const DecodedCall& call = batch_->call();
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    PACKD_RETURN_IF_ERROR(CheckStartsWithMask(
        call.tensors[i], call.mask, absl::StrCat("batch.inputs[", i, "]"),
        "batch.mask"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayoutValues> TrainingStep::CheckBatchLayout(
    const v1::PlanRequest& plan) const {
  // Every micro-batch is packed with the batch's layout: a layout Pack would
  // refuse is refused before the plan is sent.
  const DecodedCall& call = batch_->call();
  std::vector<DType> dtypes;
  for (const TensorView& x : call.tensors) dtypes.push_back(x.dtype);
  const LayoutOptions& layout = spec_.layout;
  absl::StatusOr<LayoutValues> values = CheckLayout(layout, dtypes);
  absl::Status checked = values.status();
  if (checked.ok()) {
    checked = ValidateSharedPrefix(layout, call.mask.shape[0], dtypes.size(),
                                   call.segment_ids.has_value(),
                                   /*for_pack=*/true);
  }
  if (!checked.ok()) {
    return absl::Status(checked.code(),
                        absl::StrCat("batch.", checked.message()));
  }
  if (layout.shared_prefix.has_value() && plan.groups_size() > 0) {
    return absl::InvalidArgumentError(
        "plan.groups must be empty with batch.shared_prefix: its groups are "
        "the planning units");
  }
  return values;
}

absl::Status TrainingStep::Measure(v1::PlanRequest* plan,
                                   std::vector<MeasuredRow>* rows) {
  const std::optional<TensorView>& loss = batch_->loss_mask();
  // One Pack of the loss mask (or the mask) on the host: the rows' active
  // counts, their documents, and the loss mask's active values.
  PackOptions measure;
  measure.device = Device::Cpu();
  measure.segment_ids = batch_->segment_ids();
  PACKD_ASSIGN_OR_RETURN(PackResult r, Pack({loss.value_or(batch_->mask())},
                                            batch_->mask(), measure));
  if (spec_.mrope.has_value()) {
    PACKD_RETURN_IF_ERROR(MeasureGrids(measure));
  }
  const PlanOptions model = PlanOptionsOf(*plan);
  // The costs packd computes stand for the model.
  plan->clear_cost_per_token();
  plan->clear_cost_per_token_squared();
  const std::optional<DType> loss_dtype =
      loss.has_value() ? std::optional<DType>(loss->dtype) : std::nullopt;
  MeasuredRows measured;
  if (spec_.layout.shared_prefix.has_value()) {
    // The whole batch's stream (never sent, so not bounded by a message):
    // prompts within their rows' tokens, and the prompts that must agree
    // compared, before anything is planned.
    PACKD_ASSIGN_OR_RETURN(
        measured, MeasureSharedRows(r, loss_dtype, spec_.layout, model));
    PACKD_RETURN_IF_ERROR(CheckSamePrompts(r.cu_seqlens));
  } else {
    measured = MeasureRows(r, loss_dtype, batch_->segment_ids().has_value(),
                           spec_.sizes, model);
  }
  for (size_t b = 0; b < measured.lengths.size(); ++b) {
    plan->add_lengths(measured.lengths[b]);
    plan->add_costs(measured.costs[b]);
    plan->add_loss_tokens(measured.loss_tokens[b]);
  }
  extents_ = std::move(measured.extents);
  *rows = std::move(measured.rows);
  return absl::OkStatus();
}

absl::Status TrainingStep::MeasureGrids(PackOptions measure) {
  const MRopeOptions& mrope = *spec_.mrope;
  auto in_batch = [](const absl::Status& status) {
    return absl::Status(status.code(),
                        absl::StrCat("batch.", status.message()));
  };
  const DecodedCall& call = batch_->call();
  if (absl::Status valid = ValidateMRope(mrope, call.tensors.size());
      !valid.ok()) {
    return in_batch(valid);
  }
  // The batch's token ids packed on the host, their multimodal positions
  // computed once over the whole batch (which checks every grid against its
  // run), then each row's runs counted.
  PACKD_ASSIGN_OR_RETURN(TensorView ids,
                         batch_->OnHost(call.tensors[mrope.input]));
  measure.mrope = mrope;
  absl::StatusOr<PackResult> r = Pack({ids}, batch_->mask(), measure);
  if (!r.ok()) return in_batch(r.status());
  const TensorView& packed = r->packed[0].view;
  std::vector<int64_t> dense(r->total_active);
  for (int64_t k = 0; k < r->total_active; ++k) {
    dense[k] = IntegerAt(packed.data, packed.dtype, k);
  }
  mrope_rows_ = VisionRunsByRow(
      dense, call.segment_ids.has_value() ? r->doc_cu_seqlens : r->cu_seqlens,
      r->cu_seqlens, mrope);
  return absl::OkStatus();
}

absl::Status TrainingStep::CheckSamePrompts(
    const std::vector<int64_t>& cu_seqlens) {
  const SharedPrefix& shared = *spec_.layout.shared_prefix;
  for (int32_t i : shared.same_inputs) {
    PACKD_ASSIGN_OR_RETURN(const TensorView x,
                           batch_->OnHost(batch_->call().tensors[i]));
    PackOptions host;
    host.device = Device::Cpu();
    PACKD_ASSIGN_OR_RETURN(PackResult packed, Pack({x}, batch_->mask(), host));
    PACKD_RETURN_IF_ERROR(packd::CheckSamePrompts(
        shared, cu_seqlens, i,
        static_cast<const unsigned char*>(packed.packed[0].view.data),
        PositionBytes(x)));
  }
  return absl::OkStatus();
}

absl::Status TrainingStep::Choose(const v1::PackMicroBatchesRequest& request,
                                  const std::vector<MeasuredRow>& rows) {
  const DecodedCall& call = batch_->call();
  const HostGather gather = HostGather::Of(
      call.mask, call.segment_ids.has_value() ? &*call.segment_ids : nullptr,
      call.tensors);
  PACKD_ASSIGN_OR_RETURN(
      MicroBatchTables tables,
      PlaceMicroBatches(
          plan_,
          absl::MakeConstSpan(request.ranks().data(), request.ranks_size()),
          request.plan().num_ranks(), rows, spec_.layout, spec_.sizes,
          call.tensors, gather, max_message_bytes_));
  sent_ = std::move(tables.sent);
  output_bytes_ = tables.output_bytes;
  max_micro_batch_bytes_ = tables.max_micro_batch_bytes;
  return absl::OkStatus();
}

int64_t TrainingStep::held_bytes() const {
  const int64_t two = SaturatingMul(2, max_micro_batch_bytes_);
  return pass_.has_value() && !outputs_.has_value()
             ? SaturatingAdd(two, output_bytes_)
             : two;
}

absl::Duration TrainingStep::device_time() const {
  return pass_.has_value() ? pass_->time() : absl::ZeroDuration();
}

absl::Status TrainingStep::Message(size_t k,
                                   Wire<v1::PackMicroBatchesResponse>* response,
                                   std::vector<Buffer>* buffers) const {
  if (k > 0) return PackMicroBatch(k - 1, response, buffers);
  *response->message().mutable_plan() = plan_;
  response->message().set_output_bytes(output_bytes_);
  return absl::OkStatus();
}

absl::Status TrainingStep::PackMicroBatch(
    size_t k, Wire<v1::PackMicroBatchesResponse>* response,
    std::vector<Buffer>* buffers) const {
  const MicroBatchPlace& sent = sent_[k];
  const v1::MicroBatch& mb = *sent.micro_batch;
  const absl::Span<const int64_t> rows(mb.samples().data(), mb.samples_size());
  v1::PackMicroBatchesResponse* message = &response->message();
  message->set_rank(mb.rank());
  message->set_index(sent.index);
  *message->mutable_samples() = mb.samples();
  v1::PackResponse* packed = message->mutable_packed();
  const DecodedCall& call = batch_->call();
  const ResultSlot slot = PackSlots(packed, call.tensors.size());
  // The micro-batch's spec, derived from the batch's: its rows' shared
  // prompts and vision grids, in plan order.
  const CallSpec spec = spec_.OfRows(rows, mrope_rows_);
  CallOptions base;
  base.device = call.device;
  // Into the outputs at the micro-batch's places, or into the reply.
  std::vector<ResolvedSlice> places;
  google::protobuf::RepeatedPtrField<v1::RegionSlice> written;
  if (outputs_.has_value()) {
    for (size_t i = 0; i < sent.offsets.size(); ++i) {
      places.push_back(ResolvedSlice{outputs_->region,
                                     outputs_->data + sent.offsets[i],
                                     outputs_->offset + sent.offsets[i],
                                     static_cast<uint64_t>(sent.bytes[i])});
      v1::RegionSlice* slice = written.Add();
      slice->set_region(outputs_slice_.region());
      slice->set_offset(outputs_slice_.offset() + sent.offsets[i]);
    }
    base.allocate = IntoSlices(&places);
  } else {
    base.allocate =
        IntoReply(response, slot, buffers, max_message_bytes_,
                  spec.ReservedBytes(static_cast<int64_t>(rows.size())));
  }
  // Every micro-batch's results gathered on the device in one pass; the
  // message assembled from it.
  if (pass_.has_value()) return pass_->Message(k, packed, base, written);
  // The rows in plan order, as a batch of their own: only the positions that
  // can reach the result when the host packs (Backend::Gather reads active
  // positions only), whole rows when a GPU does; in place before Pack runs
  // on a stream of its own.
  PACKD_ASSIGN_OR_RETURN(
      const GatheredRows gathered,
      batch_->GatherRows(
          rows, call.device.kind == DeviceKind::kCpu ? &extents_ : nullptr));
  PACKD_ASSIGN_OR_RETURN(PackResult result,
                         Pack(gathered.inputs, gathered.mask,
                              spec.PackOptionsFor(base, gathered.segment_ids)));
  EncodeResults(SetPackResponse(std::move(result), packed), written, slot);
  return absl::OkStatus();
}

}  // namespace packd
