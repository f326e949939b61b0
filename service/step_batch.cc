#include "service/step_batch.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/device_runtime.h"
#include "kernels/device_staging.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "service/row_prefixes.h"

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

// The device work of one gather: its runtime and stream (set by the first
// device tensor gathered), waited for by Wait() or when it goes, so that no
// copy outlives the buffers it writes (declare it after them).
struct DeviceGather {
  DeviceRuntime* runtime = nullptr;
  std::optional<Stream> stream;
  absl::Status Wait() {
    if (runtime == nullptr) return absl::OkStatus();
    absl::Status done = runtime->Synchronize(*stream);
    runtime = nullptr;
    return done;
  }
  ~DeviceGather() { (void)Wait(); }
};

// A view of rows `rows` of `x` ([B, S, ...]) gathered, kept in `held`: in
// host memory into a pooled buffer (`extents`: only positions [0, extents[b])
// of row b), or on x's device into its memory, queued on `device`'s stream
// (which may be null for a tensor in host memory).
absl::StatusOr<TensorView> GatherTensorRows(const TensorView& x,
                                            absl::Span<const int64_t> rows,
                                            const std::vector<int64_t>* extents,
                                            DeviceGather* device,
                                            std::vector<Buffer>* held) {
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
  PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                         HostBufferPool::Global().Acquire(bytes));
  const char* src = static_cast<const char*>(x.data);
  GatherRowPrefixes(
      static_cast<int64_t>(rows.size()), [&](int64_t j) { return rows[j]; },
      extents, row, position, static_cast<char*>(buffer.data()),
      [src](int64_t from, int64_t n, char* to) {
        std::memcpy(to, src + from, n);
      });
  out.data = buffer.data();
  held->push_back(std::move(buffer));
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepBatch>> StepBatch::Make(
    const Wire<v1::PackMicroBatchesRequest>& request,
    const RequestDecoder& decoder, const CallSpec& spec) {
  const v1::PackMicroBatchesRequest& message = request.message();
  PACKD_ASSIGN_OR_RETURN(DecodedCall call,
                         decoder.Decode(message.batch(), request, spec));
  std::optional<TensorView> loss;
  if (message.has_loss_mask()) {
    PACKD_ASSIGN_OR_RETURN(
        loss, decoder.DecodeTensor(message.loss_mask(), "loss_mask", &call));
  }
  return Of(std::move(call), std::move(loss));
}

absl::StatusOr<std::unique_ptr<StepBatch>> StepBatch::Of(
    DecodedCall call, std::optional<TensorView> loss_mask) {
  auto batch = std::unique_ptr<StepBatch>(new StepBatch());
  batch->call_ = std::move(call);
  PACKD_RETURN_IF_ERROR(batch->CheckDevices(loss_mask));
  return batch;
}

std::vector<std::pair<const TensorView*, std::string>> StepBatch::Named()
    const {
  std::vector<std::pair<const TensorView*, std::string>> named = {
      {&call_.mask, "batch.mask"}};
  for (size_t i = 0; i < call_.tensors.size(); ++i) {
    named.push_back({&call_.tensors[i], absl::StrCat("batch.inputs[", i, "]")});
  }
  if (call_.segment_ids.has_value()) {
    named.push_back({&*call_.segment_ids, "batch.segment_ids"});
  }
  return named;
}

absl::Status StepBatch::CheckDevices(const std::optional<TensorView>& loss) {
  for (const auto& [t, field] : Named()) {
    PACKD_RETURN_IF_ERROR(OnCallDevice(*t, call_.device, field));
  }
  if (loss.has_value()) {
    PACKD_RETURN_IF_ERROR(OnCallDevice(*loss, call_.device, "loss_mask"));
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

absl::StatusOr<TensorView> StepBatch::OnHost(const TensorView& t) {
  TensorView host;
  PACKD_RETURN_IF_ERROR(OnHost({{&t, &host}}));
  return host;
}

absl::Status StepBatch::OnHost(
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

absl::StatusOr<GatheredRows> StepBatch::GatherMasks(
    absl::Span<const int64_t> rows) const {
  GatheredRows out;
  // Both in host memory: copied, no device work.
  PACKD_ASSIGN_OR_RETURN(out.mask, GatherTensorRows(host_mask_, rows, nullptr,
                                                    nullptr, &out.held));
  if (host_segment_ids_.has_value()) {
    PACKD_ASSIGN_OR_RETURN(out.segment_ids,
                           GatherTensorRows(*host_segment_ids_, rows, nullptr,
                                            nullptr, &out.held));
  }
  return out;
}

absl::StatusOr<GatheredRows> StepBatch::GatherRows(
    absl::Span<const int64_t> rows, const std::vector<int64_t>* extents) const {
  PACKD_ASSIGN_OR_RETURN(GatheredRows out, GatherMasks(rows));
  // Declared after `out`: however this returns, the device's copies are
  // waited for before the buffers they write go.
  DeviceGather device;
  for (const TensorView& x : call_.tensors) {
    PACKD_ASSIGN_OR_RETURN(
        TensorView v, GatherTensorRows(x, rows, extents, &device, &out.held));
    out.inputs.push_back(std::move(v));
  }
  PACKD_RETURN_IF_ERROR(device.Wait());
  return out;
}

absl::StatusOr<ResolvedSlice> StepBatch::ResolveOutputs(
    const v1::RegionSlice& slice, const RequestDecoder& decoder,
    const Tenant& tenant) const {
  PACKD_ASSIGN_OR_RETURN(ResolvedSlice outputs,
                         decoder.ResolveSlice(tenant, slice, "outputs"));
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
  for (const auto& [x, name] : Named()) {
    const char* p = static_cast<const char*>(x->data);
    if (outputs.byte_size > 0 && x->device == place && x->nbytes() > 0 &&
        p < end && begin < p + x->nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs overlaps ", name,
          ": results are written while the batch is read; give a slice of "
          "its own"));
    }
  }
  return outputs;
}

}  // namespace packd
