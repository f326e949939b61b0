#include "service/step.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "kernels/device_staging.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "kernels/pack_sizes.h"
#include "kernels/registry.h"
#include "kernels/shared_prefix.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"
#include "service/pack_reply.h"
#include "service/step_parts.h"

namespace packd {
namespace {

// OK when `t` is in host memory or on the call's device; the batch's device
// tensors are read where they are, on the device that packs them.
absl::Status OnCallDevice(const TensorView& t, const Device& call,
                          absl::string_view field) {
  if (t.device.kind == DeviceKind::kCpu || t.device == call) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is in a region on ", t.device.ToString(),
      " but the step runs on ", call.ToString(),
      ": give batch.device as the tensors' device (or put every device "
      "tensor of the batch on one device)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingStep>> TrainingStep::Make(
    const Wire<v1::PackMicroBatchesRequest>& request,
    const RequestDecoder& decoder, int64_t max_message_bytes,
    const Tenant& tenant) {
  const absl::Time start = absl::Now();
  const v1::PackMicroBatchesRequest& message = request.message();
  PACKD_RETURN_IF_ERROR(CheckStepRequest(message));
  auto step = std::unique_ptr<TrainingStep>(
      new TrainingStep(message.batch(), max_message_bytes, tenant));
  PACKD_ASSIGN_OR_RETURN(step->call_,
                         decoder.Decode(message.batch(), request, step->spec_));
  PACKD_RETURN_IF_ERROR(step->CheckDevices(
      message.has_loss_mask() ? &message.loss_mask() : nullptr, decoder));
  // Every micro-batch is packed with the batch's layout: a layout Pack would
  // refuse is refused before the plan is sent.
  std::vector<DType> dtypes;
  for (const TensorView& x : step->call_.tensors) dtypes.push_back(x.dtype);
  const LayoutOptions& layout = step->spec_.layout;
  absl::Status checked = CheckLayout(layout, dtypes).status();
  if (checked.ok()) {
    checked =
        ValidateSharedPrefix(layout, step->call_.mask.shape[0], dtypes.size(),
                             step->call_.segment_ids.has_value(),
                             /*for_pack=*/true);
  }
  if (!checked.ok()) {
    return absl::Status(checked.code(),
                        absl::StrCat("batch.", checked.message()));
  }
  if (layout.shared_prefix.has_value() && message.plan().groups_size() > 0) {
    return absl::InvalidArgumentError(
        "plan.groups must be empty with batch.shared_prefix: its groups are "
        "the planning units");
  }
  v1::PlanRequest filled = message.plan();
  std::vector<MeasuredRow> rows;
  PACKD_RETURN_IF_ERROR(step->Measure(&filled, &rows));
  step->measured_ = filled;
  const absl::Time measured = absl::Now();
  step->phases_.measure = measured - start;
  // The mask is valid now (Measure packed it); the inputs' rows are gathered
  // per micro-batch before any Pack sees them, so their shapes are checked
  // here.
  for (size_t i = 0; i < step->call_.tensors.size(); ++i) {
    PACKD_RETURN_IF_ERROR(CheckStartsWithMask(
        step->call_.tensors[i], step->call_.mask,
        absl::StrCat("batch.inputs[", i, "]"), "batch.mask"));
  }
  PACKD_ASSIGN_OR_RETURN(const Plan planned,
                         PlanStepRows(filled, layout, max_message_bytes));
  EncodePlan(planned, &step->plan_);
  PACKD_RETURN_IF_ERROR(
      decoder.CheckSize("plan message", step->plan_.ByteSizeLong()));
  PACKD_RETURN_IF_ERROR(step->Choose(message, rows));
  if (message.has_outputs()) {
    PACKD_RETURN_IF_ERROR(step->UseOutputs(message.outputs(), decoder));
  }
  step->device_pass_ = step->UsesDevicePass();
  if (step->device_pass_) step->prepared_.resize(step->sent_.size());
  step->phases_.plan = absl::Now() - measured;
  return step;
}

absl::Status TrainingStep::Measure(v1::PlanRequest* plan,
                                   std::vector<MeasuredRow>* rows) {
  const TensorView& mask = host_mask_;
  const std::optional<TensorView>& loss = host_loss_;
  // One Pack of the loss mask (or the mask) on the host: the rows' active
  // counts, their documents, and the loss mask's active values.
  PackOptions measure;
  measure.device = Device::Cpu();
  measure.segment_ids = host_segment_ids_;
  PACKD_ASSIGN_OR_RETURN(
      PackResult r, Pack({loss.has_value() ? *loss : mask}, mask, measure));
  if (spec_.mrope.has_value()) {
    PACKD_RETURN_IF_ERROR(MeasureGrids(measure));
  }
  const PlanOptions model = PlanOptionsOf(*plan);
  // The costs packd computes stand for the model.
  plan->clear_cost_per_token();
  plan->clear_cost_per_token_squared();
  if (spec_.layout.shared_prefix.has_value()) {
    const int64_t B = mask.shape[0];
    extents_.resize(B);
    for (int64_t b = 0; b < B; ++b) extents_[b] = r.last_index[b] + 1;
    rows->assign(B, {});
    return MeasureShared(r, loss, model, plan, rows);
  }
  MeasuredRows measured = MeasureRows(
      r, loss.has_value() ? std::optional<DType>(loss->dtype) : std::nullopt,
      call_.segment_ids.has_value(), spec_.sizes, model);
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
  if (absl::Status valid = ValidateMRope(mrope, call_.tensors.size());
      !valid.ok()) {
    return in_batch(valid);
  }
  // The batch's token ids packed on the host, their multimodal positions
  // computed once over the whole batch (which checks every grid against its
  // run), then each row's runs counted.
  PACKD_ASSIGN_OR_RETURN(TensorView ids, OnHost(call_.tensors[mrope.input]));
  measure.mrope = mrope;
  absl::StatusOr<PackResult> r = Pack({ids}, host_mask_, measure);
  if (!r.ok()) return in_batch(r.status());
  const TensorView& packed = r->packed[0].view;
  std::vector<int64_t> dense(r->total_active);
  for (int64_t k = 0; k < r->total_active; ++k) {
    dense[k] = IntegerAt(packed.data, packed.dtype, k);
  }
  mrope_rows_ = VisionRunsByRow(
      dense, call_.segment_ids.has_value() ? r->doc_cu_seqlens : r->cu_seqlens,
      r->cu_seqlens, mrope);
  return absl::OkStatus();
}

absl::Status TrainingStep::MeasureShared(const PackResult& r,
                                         const std::optional<TensorView>& loss,
                                         const PlanOptions& model,
                                         v1::PlanRequest* plan,
                                         std::vector<MeasuredRow>* rows) {
  // The whole batch's stream (never sent, so not bounded by a message):
  // prompts within their rows' tokens, and the prompts that must agree
  // checked on the host, before anything is planned.
  LayoutOptions layout = spec_.layout;
  layout.max_rows = 0;
  const SharedPrefix& shared = *layout.shared_prefix;
  PACKD_ASSIGN_OR_RETURN(
      const Layout stream,
      MakeSharedLayout(r.cu_seqlens, layout, /*with_position_ids=*/false));
  for (int32_t i : shared.same_inputs) {
    PACKD_ASSIGN_OR_RETURN(const TensorView x, OnHost(call_.tensors[i]));
    PackOptions host;
    host.device = Device::Cpu();
    PACKD_ASSIGN_OR_RETURN(PackResult packed, Pack({x}, host_mask_, host));
    PACKD_RETURN_IF_ERROR(CheckSamePrompts(
        shared, r.cu_seqlens, i,
        static_cast<const unsigned char*>(packed.packed[0].view.data),
        PositionBytes(x)));
  }
  const SharedLayout& s = *stream.shared;
  const int64_t B = static_cast<int64_t>(rows->size());
  // Each segment costs its row (a prompt's: its group's first).
  std::vector<int64_t> length(B, 0);
  std::vector<double> cost(B, 0);
  for (size_t n = 0; n + 1 < s.cu_seqlens_q.size(); ++n) {
    const int64_t b = s.segment_row[n];
    const int64_t q = s.cu_seqlens_q[n + 1] - s.cu_seqlens_q[n];
    const int64_t k = s.cu_seqlens_k[n + 1] - s.cu_seqlens_k[n];
    length[b] += q;
    cost[b] += SegmentCost(model, q, k);
    (*rows)[b].keys += k;
    ++(*rows)[b].segments;
  }
  const char* loss_bytes = loss.has_value()
                               ? static_cast<const char*>(r.packed[0].view.data)
                               : nullptr;
  const int64_t loss_item = loss.has_value() ? ItemSize(loss->dtype) : 0;
  for (int64_t b = 0; b < B; ++b) {
    // Row b's targets are its active tokens j >= max(P, 1).
    const int64_t active = r.cu_seqlens[b + 1] - r.cu_seqlens[b];
    const int64_t first =
        std::min(active, std::max<int64_t>(shared.prefix_lengths[b], 1));
    (*rows)[b].targets = active - first;
    plan->add_lengths(length[b]);
    plan->add_costs(cost[b]);
    plan->add_loss_tokens(
        loss_bytes == nullptr
            ? active - first
            : CountNonzero(loss->dtype,
                           loss_bytes + (r.cu_seqlens[b] + first) * loss_item,
                           active - first));
  }
  return absl::OkStatus();
}

absl::Status TrainingStep::Choose(const v1::PackMicroBatchesRequest& request,
                                  const std::vector<MeasuredRow>& rows) {
  const int64_t position_bytes = HostGatherBytesPerPosition(
      call_.mask, call_.segment_ids.has_value() ? &*call_.segment_ids : nullptr,
      call_.tensors);
  PACKD_ASSIGN_OR_RETURN(
      MicroBatchTables tables,
      PlaceMicroBatches(
          plan_,
          absl::MakeConstSpan(request.ranks().data(), request.ranks_size()),
          request.plan().num_ranks(), rows, spec_.layout, spec_.sizes,
          call_.tensors, position_bytes, max_message_bytes_));
  sent_ = std::move(tables.sent);
  output_bytes_ = tables.output_bytes;
  max_micro_batch_bytes_ = tables.max_micro_batch_bytes;
  return absl::OkStatus();
}

absl::Status TrainingStep::UseOutputs(const v1::RegionSlice& slice,
                                      const RequestDecoder& decoder) {
  PACKD_ASSIGN_OR_RETURN(ResolvedSlice outputs,
                         decoder.ResolveSlice(spec_.tenant, slice, "outputs"));
  const Device& place = outputs.region->device();
  if (place.kind != DeviceKind::kCpu && place != call_.device) {
    return absl::InvalidArgumentError(
        absl::StrCat("outputs is a region on ", place.ToString(),
                     " but the step runs on ", call_.device.ToString(),
                     ": give outputs in host memory or on the step's device"));
  }
  // The results are written while the batch is read: no byte of one may be
  // the other's.
  const char* begin = outputs.data;
  const char* end = begin + outputs.byte_size;
  auto overlaps = [&](const TensorView& x) {
    const char* p = static_cast<const char*>(x.data);
    return x.device == place && x.nbytes() > 0 && p < end &&
           begin < p + x.nbytes();
  };
  std::vector<std::pair<const TensorView*, std::string>> tensors = {
      {&call_.mask, "batch.mask"}};
  for (size_t i = 0; i < call_.tensors.size(); ++i) {
    tensors.push_back(
        {&call_.tensors[i], absl::StrCat("batch.inputs[", i, "]")});
  }
  if (call_.segment_ids.has_value()) {
    tensors.push_back({&*call_.segment_ids, "batch.segment_ids"});
  }
  for (const auto& [x, name] : tensors) {
    if (outputs.byte_size > 0 && overlaps(*x)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs overlaps ", name,
          ": results are written while the batch is read; give a slice of "
          "its own"));
    }
  }
  // Too small: the results come inline (a client keeps the last step's
  // output_bytes and has room from the next step of its shape on).
  if (static_cast<int64_t>(outputs.byte_size) < output_bytes_) {
    return absl::OkStatus();
  }
  outputs_ = std::move(outputs);
  outputs_slice_ = slice;
  return absl::OkStatus();
}

absl::Status TrainingStep::CheckDevices(const v1::Tensor* loss_mask,
                                        const RequestDecoder& decoder) {
  const Device& device = call_.device;
  std::vector<std::pair<const TensorView*, std::string>> batch = {
      {&call_.mask, "batch.mask"}};
  for (size_t i = 0; i < call_.tensors.size(); ++i) {
    batch.push_back({&call_.tensors[i], absl::StrCat("batch.inputs[", i, "]")});
  }
  if (call_.segment_ids.has_value()) {
    batch.push_back({&*call_.segment_ids, "batch.segment_ids"});
  }
  for (const auto& [t, field] : batch) {
    PACKD_RETURN_IF_ERROR(OnCallDevice(*t, device, field));
  }
  std::optional<TensorView> loss;
  if (loss_mask != nullptr) {
    PACKD_ASSIGN_OR_RETURN(
        loss, decoder.DecodeTensor(*loss_mask, "loss_mask", &call_));
    PACKD_RETURN_IF_ERROR(OnCallDevice(*loss, device, "loss_mask"));
    if (absl::MakeConstSpan(loss->shape) !=
        absl::MakeConstSpan(call_.mask.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_mask.shape ", ShapeString(loss->shape),
                       " must equal the batch's mask shape ",
                       ShapeString(call_.mask.shape)));
    }
  }
  // The [B, S] mask, ids and loss mask are measured and planned on the host:
  // one copy of each (a few bytes a position), waited for once, is simpler to
  // get right than a device scan per measure, and the plan needs them on the
  // host anyway.
  std::vector<std::pair<const TensorView*, TensorView*>> wanted = {
      {&call_.mask, &host_mask_}};
  if (call_.segment_ids.has_value()) {
    host_segment_ids_.emplace();
    wanted.push_back({&*call_.segment_ids, &*host_segment_ids_});
  }
  if (loss.has_value()) {
    host_loss_.emplace();
    wanted.push_back({&*loss, &*host_loss_});
  }
  return OnHost(wanted);
}

absl::StatusOr<TensorView> TrainingStep::OnHost(const TensorView& t) {
  TensorView host;
  PACKD_RETURN_IF_ERROR(OnHost({{&t, &host}}));
  return host;
}

absl::Status TrainingStep::OnHost(
    absl::Span<const std::pair<const TensorView*, TensorView*>> wanted) {
  DeviceRuntime* runtime = nullptr;
  std::optional<Stream> stream;
  // Copies queued into pinned memory, then one wait; a large tensor's copy
  // waits as it goes (DeviceRuntime::CopyToHost's bounded staging).
  struct Queued {
    void* to;
    const void* from;
    int64_t bytes;
  };
  std::vector<Queued> queued;
  std::vector<Buffer> pinned;
  for (const auto& [t, host] : wanted) {
    *host = *t;
    if (t->device.kind == DeviceKind::kCpu) continue;
    host->device = Device::Cpu();
    host->data = nullptr;
    if (runtime == nullptr) {
      // The device is checked first: FAILED_PRECONDITION when it is missing,
      // UNAVAILABLE once it is lost, as for Pack.
      PACKD_ASSIGN_OR_RETURN(runtime, Registry::Runtime(t->device));
      PACKD_ASSIGN_OR_RETURN(stream, runtime->AcquireStream(t->device));
    }
    const int64_t bytes = t->nbytes();
    if (bytes == 0) continue;
    PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                           HostBufferPool::Global().Acquire(bytes));
    host->data = buffer.data();
    if (bytes <= DeviceStaging::kQueuedBytes) {
      PACKD_ASSIGN_OR_RETURN(Buffer staged,
                             runtime->AllocateHost(bytes, t->device));
      PACKD_RETURN_IF_ERROR(runtime->CopyAsync(staged.data(), t->data, bytes,
                                               CopyDirection::kDeviceToHost,
                                               *stream));
      queued.push_back({buffer.data(), staged.data(), bytes});
      pinned.push_back(std::move(staged));
    } else {
      PACKD_RETURN_IF_ERROR(
          runtime->CopyToHost(buffer.data(), t->data, bytes, *stream));
    }
    host_copies_.push_back(std::move(buffer));
  }
  if (runtime == nullptr) return absl::OkStatus();
  PACKD_RETURN_IF_ERROR(runtime->Synchronize(*stream));
  for (const Queued& q : queued) std::memcpy(q.to, q.from, q.bytes);
  return absl::OkStatus();
}

absl::StatusOr<TensorView> TrainingStep::GatherRows(
    const TensorView& x, absl::Span<const int64_t> rows,
    const std::vector<int64_t>* extents, DeviceGather* device,
    std::vector<Buffer>* held) const {
  TensorView out = x;
  out.shape[0] = static_cast<int64_t>(rows.size());
  const int64_t position = PositionBytes(x);
  const int64_t row = x.shape[1] * position;
  const int64_t bytes = out.nbytes();
  if (bytes == 0) {
    out.data = nullptr;
    return out;
  }
  if (x.device.kind != DeviceKind::kCpu) {
    // Whole rows, on the device, on the micro-batch's stream.
    if (device->runtime == nullptr) {
      PACKD_ASSIGN_OR_RETURN(device->runtime, Registry::Runtime(x.device));
      PACKD_ASSIGN_OR_RETURN(device->stream,
                             device->runtime->AcquireStream(x.device));
    }
    PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                           device->runtime->Allocate(bytes, x.device));
    PACKD_RETURN_IF_ERROR(device->runtime->CopyRows(buffer.data(), x.data, rows,
                                                    row, *device->stream));
    out.data = buffer.data();
    held->push_back(std::move(buffer));
    return out;
  }
  out.device = Device::Cpu();
  PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                         HostBufferPool::Global().Acquire(bytes));
  char* dst = static_cast<char*>(buffer.data());
  const char* src = static_cast<const char*>(x.data);
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n = extents != nullptr ? (*extents)[rows[j]] * position : row;
    std::memcpy(dst + j * row, src + rows[j] * row, n);
  }
  out.data = dst;
  held->push_back(std::move(buffer));
  return out;
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
  const ResultSlot slot = PackSlots(packed, call_.tensors.size());
  // The micro-batch's spec, derived from the batch's: its rows' shared
  // prompts and vision grids, in plan order.
  const CallSpec spec = spec_.OfRows(rows, mrope_rows_);
  CallOptions base;
  base.device = call_.device;
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
  if (device_pass_) {
    // Every micro-batch's results are gathered on the device in one pass;
    // the message is assembled from it.
    PACKD_RETURN_IF_ERROR(DevicePassOnce(k));
    return MessageFromPass(k, packed, base, written);
  }
  // The rows in plan order, as a batch of their own: only the positions that
  // can reach the result when the host packs (Backend::Gather reads active
  // positions only), whole rows when a GPU does.
  const std::vector<int64_t>* extents =
      call_.device.kind == DeviceKind::kCpu ? &extents_ : nullptr;
  // The mask and ids from their host copies (Pack stages them); inputs in
  // device memory on their device, into buffers that outlive the gather's
  // stream (`device` waits for it, however this returns).
  std::vector<Buffer> gathered;
  DeviceGather device;
  PACKD_ASSIGN_OR_RETURN(TensorView mask, GatherRows(host_mask_, rows, nullptr,
                                                     &device, &gathered));
  std::vector<TensorView> inputs;
  for (const TensorView& x : call_.tensors) {
    PACKD_ASSIGN_OR_RETURN(TensorView v,
                           GatherRows(x, rows, extents, &device, &gathered));
    inputs.push_back(std::move(v));
  }
  std::optional<TensorView> segment_ids;
  if (host_segment_ids_.has_value()) {
    PACKD_ASSIGN_OR_RETURN(
        segment_ids,
        GatherRows(*host_segment_ids_, rows, nullptr, &device, &gathered));
  }
  // Pack runs on a stream of its own: the rows are in place first.
  PACKD_RETURN_IF_ERROR(device.Wait());
  PACKD_ASSIGN_OR_RETURN(
      PackResult result,
      Pack(inputs, mask, spec.PackOptionsFor(base, segment_ids)));
  EncodeResults(SetPackResponse(std::move(result), packed), written, slot);
  return absl::OkStatus();
}

}  // namespace packd
