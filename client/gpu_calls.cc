// Client calls whose tensors are on a GPU: the tensors travel as slices of
// device regions (the allocations holding them, registered once each), the
// results are allocated on the same GPU and written there by packd.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "base/torch_interop.h"
#include "client/client.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// A GPU Pack whose inputs take at most this many bytes gets outputs with room
// for every row (the Python client's ROOM_FOR_ALL_BYTES).
constexpr int64_t kRoomForAllBytes = int64_t{64} << 20;

// Device regions of this process are "cpp-gpu-PID-N".
std::string NewGpuRegionName() {
  static std::atomic<int64_t> next{0};
  return absl::StrCat("cpp-gpu-", getpid(), "-", next++);
}

// Sizes, as a vector, of [lead..., t.sizes()[from:]...].
std::vector<int64_t> WithTail(std::vector<int64_t> lead, const at::Tensor& t,
                              int64_t from) {
  for (int64_t d = from; d < t.dim(); ++d) lead.push_back(t.size(d));
  return lead;
}

}  // namespace

absl::StatusOr<std::optional<int>> Client::GpuOf(const Named& tensors) const {
  const std::string* first_name = nullptr;
  std::optional<int> first;
  auto label = [&](const std::optional<int>& index) {
    return index.has_value() ? device_memory_->Name(*index) : "cpu";
  };
  for (const auto& [name, t] : tensors) {
    if (!t->defined()) continue;
    std::optional<int> index;
    if (device_memory_ != nullptr) index = device_memory_->DeviceOf(*t);
    // Host tensors without bytes go with any device.
    if (!index.has_value() && t->device().is_cpu() && t->numel() == 0) continue;
    if (first_name == nullptr) {
      first_name = &name;
      first = index;
    } else if (index != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          *first_name, " is on ", label(first), " but ", name, " is on ",
          label(index), ": the tensors of one call must be on one device"));
    }
  }
  return first;
}

absl::StatusOr<std::string> Client::GpuUuid(int index) {
  {
    absl::MutexLock lock(&mu_);
    auto it = uuids_.find(index);
    if (it != uuids_.end()) return it->second;
  }
  PACKD_ASSIGN_OR_RETURN(std::string uuid, device_memory_->Uuid(index));
  absl::MutexLock lock(&mu_);
  uuids_[index] = uuid;
  return uuid;
}

absl::StatusOr<v1::RegionSlice> Client::GpuSlice(const at::Tensor& t, int index,
                                                 Outgoing* outgoing) {
  PACKD_ASSIGN_OR_RETURN(DeviceMemory::Allocation allocation,
                         device_memory_->AllocationOf(t));
  std::optional<std::string> found =
      gpu_allocations_.Find(index, allocation.base, allocation.ipc_handle);
  std::string region = found.value_or("");
  if (!found.has_value()) {
    UnregisterFreed();
    PACKD_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(index));
    v1::RegisterDeviceRegionRequest request;
    request.set_name(NewGpuRegionName());
    request.set_ipc_handle(allocation.ipc_handle);
    request.set_device(device_memory_->Name(index));
    request.set_device_uuid(uuid);
    request.set_byte_size(allocation.size);
    request.set_lease_seconds(options_.lease_seconds);
    v1::RegisterRegionResponse response;
    PACKD_RETURN_IF_ERROR(connection_->Call([&](grpc::ClientContext* c) {
      return connection_->stub().RegisterDeviceRegion(c, request, &response);
    }));
    {
      // Known before it is found: a region freed at once is forgotten here.
      absl::MutexLock lock(&mu_);
      device_regions_[request.name()] = request;
      registrations_[request.name()] = 1;
    }
    bool added = false;
    region = gpu_allocations_.Add(index, allocation.base, allocation.ipc_handle,
                                  request.name(), &added);
    if (added) {
      device_memory_->Watch(
          allocation.base,
          gpu_allocations_.OnFreed(index, allocation.base, region));
    }
  }
  outgoing->regions.push_back(region);
  return DeviceSlice(region, reinterpret_cast<const void*>(allocation.base),
                     t.data_ptr(), t.nbytes());
}

void Client::UnregisterFreed(bool all) {
  const std::vector<std::string> names = gpu_allocations_.TakeFreed(all);
  if (names.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& region : names) {
      device_regions_.erase(region);
      registrations_.erase(region);
    }
  }
  for (const std::string& name : names) {
    // Gone already (its lease ran out), or the server is away: its lease
    // ends it.
    connection_->UnregisterRegion(name).IgnoreError();
  }
}

Client::Encoder Client::GpuEncoder(int index) {
  return
      [this, index](const at::Tensor& t, v1::Tensor* out, Outgoing* outgoing) {
        return EncodeGpuTensor(t, index, out, outgoing);
      };
}

absl::Status Client::EncodeGpuTensor(const at::Tensor& t, int index,
                                     v1::Tensor* out, Outgoing* outgoing) {
  const DType dtype = FromScalarType(t.scalar_type());
  if (dtype == DType::kUnspecified) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype ", c10::toString(t.scalar_type()), " is not one packd carries"));
  }
  EncodeTensorHeader(dtype, t.sizes().vec(), out);
  if (t.numel() == 0) {
    out->set_data("");
    return absl::OkStatus();
  }
  PACKD_ASSIGN_OR_RETURN(*out->mutable_region(), GpuSlice(t, index, outgoing));
  return absl::OkStatus();
}

absl::Status Client::CallOnGpu(
    int index, const char* method, Outgoing* outgoing,
    const std::vector<at::Tensor>& outputs,
    google::protobuf::RepeatedPtrField<v1::RegionSlice>* slices,
    WireMessage* reply) {
  for (const at::Tensor& o : outputs) {
    PACKD_ASSIGN_OR_RETURN(*slices->Add(), GpuSlice(o, index, outgoing));
  }
  // The inputs written and the outputs' memory free before packd touches
  // them.
  PACKD_RETURN_IF_ERROR(device_memory_->Synchronize(index));
  return RawCall(0, method, *outgoing, reply);
}

template <typename Request, typename Options>
absl::Status Client::EncodeAndCallOnGpu(int index, const char* method,
                                        EncodeFn<Request, Options> encode,
                                        const Options& options,
                                        const std::vector<at::Tensor>& tensors,
                                        const at::Tensor& mask,
                                        const std::vector<at::Tensor>& outputs,
                                        WireMessage* reply) {
  PACKD_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(index));
  Wire<Request> request;
  Outgoing outgoing(&request);
  PACKD_RETURN_IF_ERROR(
      encode(absl::StrCat("uuid:", uuid), options, tensors, mask,
             options.segment_ids.defined() ? options.segment_ids.contiguous()
                                           : at::Tensor(),
             GpuEncoder(index), &request.message(), &outgoing));
  return CallOnGpu(index, method, &outgoing, outputs,
                   request->mutable_outputs(), reply);
}

absl::StatusOr<std::vector<at::Tensor>> Client::GpuResults(
    const Tensors& results, const WireMessage& reply,
    const std::vector<at::Tensor>& outputs, int index) {
  std::vector<at::Tensor> out;
  if (outputs.empty()) {
    for (const v1::Tensor& t : results) {
      PACKD_ASSIGN_OR_RETURN(at::Tensor host,
                             DecodeResult(t, /*copy_out=*/true, reply));
      PACKD_ASSIGN_OR_RETURN(at::Tensor placed,
                             device_memory_->ToDevice(host, index));
      out.push_back(std::move(placed));
    }
    return out;
  }
  if (results.size() != static_cast<int>(outputs.size())) {
    return absl::InternalError("packd returned another number of results");
  }
  for (int i = 0; i < results.size(); ++i) {
    const v1::Tensor& t = results[i];
    if (!t.has_region() ||
        std::vector<int64_t>(t.shape().begin(), t.shape().end()) !=
            outputs[i].sizes().vec()) {
      return absl::InternalError(absl::StrCat(
          "packd answered shape ",
          ShapeString(std::vector<int64_t>(t.shape().begin(), t.shape().end())),
          " for a result of shape ", ShapeString(outputs[i].sizes().vec())));
    }
    out.push_back(outputs[i]);
  }
  return out;
}

absl::StatusOr<std::vector<at::Tensor>> Client::GpuOutputs(
    const std::vector<at::Tensor>& like, const std::vector<int64_t>& lead,
    int64_t tail_from, int index) {
  std::vector<at::Tensor> outputs;
  for (const at::Tensor& t : like) {
    PACKD_ASSIGN_OR_RETURN(at::Tensor o,
                           device_memory_->Empty(WithTail(lead, t, tail_from),
                                                 t.scalar_type(), index));
    // Results without bytes come inline (a slice of none names no memory).
    if (o.numel() == 0) return std::vector<at::Tensor>();
    outputs.push_back(std::move(o));
  }
  return outputs;
}

absl::StatusOr<PackedBatch> Client::PackOnGpu(
    int index, const std::vector<at::Tensor>& tensors_in,
    const at::Tensor& mask_in, const PackCallOptions& options) {
  if (!options.device.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device \"", options.device, "\" is for host tensors; these are on ",
        device_memory_->Name(index), ", where the call runs"));
  }
  if (options.results_in != nullptr) {
    return absl::InvalidArgumentError(
        "results_in is shared memory for host tensors; results of GPU tensors "
        "are written on their GPU");
  }
  UnregisterFreed();
  const at::Tensor mask = mask_in.contiguous();
  std::vector<at::Tensor> tensors;
  bool shaped = mask.dim() == 2;
  for (const at::Tensor& t : tensors_in) {
    tensors.push_back(t.contiguous());
    shaped = shaped && t.dim() >= 2;
  }
  std::vector<at::Tensor> outputs;
  // A layout's results come inline and are copied to the GPU. Small inputs
  // get outputs with room for every row, so that packd gathers without a
  // round trip for the count and nothing here waits for the GPU to count
  // (docs/gpu.md); larger ones are counted and get outputs of their size.
  bool room = false;
  if (shaped && !options.layout.any()) {
    int64_t bytes = 0;
    for (const at::Tensor& t : tensors) bytes += t.nbytes();
    room = bytes <= kRoomForAllBytes;
    const int64_t rows =
        room ? mask.numel() : at::count_nonzero(mask).item<int64_t>();
    PACKD_ASSIGN_OR_RETURN(outputs, GpuOutputs(tensors, {rows}, 2, index));
  }

  Wire<v1::PackResponse> reply;
  PACKD_RETURN_IF_ERROR(EncodeAndCallOnGpu<v1::PackRequest>(
      index, kPackMethod, &Client::EncodePack, options, tensors, mask, outputs,
      &reply));
  if (room) {
    for (at::Tensor& o : outputs) o = o.narrow(0, 0, reply->total_active());
  }
  PackedBatch batch;
  PACKD_ASSIGN_OR_RETURN(batch.packed,
                         GpuResults(reply->packed(), reply, outputs, index));
  PACKD_ASSIGN_OR_RETURN(batch.shifted,
                         GpuResults(reply->shifted(), reply, {}, index));
  FillMetadata(reply.message(), options, &batch);
  PACKD_RETURN_IF_ERROR(MetadataToDevice(index, &batch));
  return batch;
}

absl::Status Client::MetadataToDevice(int index, PackedBatch* out) {
  PackedBatch& batch = *out;
  std::vector<at::Tensor*> metadata = {
      &batch.cu_seqlens,        &batch.position_ids, &batch.last_index,
      &batch.doc_cu_seqlens,    &batch.doc_row,      &batch.doc_last_index,
      &batch.cu_seqlens_padded, &batch.seq_idx};
  if (batch.shared.has_value()) {
    PackedBatch::Shared& s = *batch.shared;
    metadata.insert(metadata.end(),
                    {&s.cu_seqlens_q, &s.cu_seqlens_k, &s.kv_index,
                     &s.pred_index, &s.target_cu_seqlens, &s.segment_row});
  }
  for (at::Tensor* t : metadata) {
    if (!t->defined()) continue;
    PACKD_ASSIGN_OR_RETURN(*t, device_memory_->ToDevice(*t, index));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> Client::ScatterOnGpu(
    int index, const std::vector<at::Tensor>& packed_in,
    const at::Tensor& mask_in, const ScatterCallOptions& options) {
  UnregisterFreed();
  const at::Tensor mask = mask_in.contiguous();
  std::vector<at::Tensor> packed;
  bool shaped = mask.dim() == 2;
  for (const at::Tensor& t : packed_in) {
    packed.push_back(t.contiguous());
    shaped = shaped && t.dim() >= 1;
  }
  std::vector<at::Tensor> outputs;
  if (shaped) {
    PACKD_ASSIGN_OR_RETURN(
        outputs, GpuOutputs(packed, {mask.size(0), mask.size(1)}, 1, index));
  }

  Wire<v1::ScatterResponse> reply;
  PACKD_RETURN_IF_ERROR(EncodeAndCallOnGpu<v1::ScatterRequest>(
      index, kScatterMethod, &Client::EncodeScatter, options, packed, mask,
      outputs, &reply));
  return GpuResults(reply->dense(), reply, outputs, index);
}

absl::StatusOr<at::Tensor> Client::ToDeviceOf(const at::Tensor& t,
                                              const at::Tensor& like) {
  if (device_memory_ == nullptr || t.numel() == 0) return t;
  const std::optional<int> index = device_memory_->DeviceOf(like);
  if (!index.has_value() || device_memory_->DeviceOf(t) == index) return t;
  return device_memory_->ToDevice(t.detach().cpu().contiguous(), *index);
}

absl::StatusOr<Client::StepResults> Client::EncodeStepOnGpu(
    int index, const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
    const StepCallOptions& options, int64_t arena,
    v1::PackMicroBatchesRequest* request, Outgoing* outgoing) {
  const PackCallOptions& pack = options.pack;
  at::Tensor gpu_arena;
  int64_t gpu_arena_offset = 0;
  UnregisterFreed();
  const at::Tensor mask_c = mask.contiguous();
  std::vector<at::Tensor> tensors_c;
  for (const at::Tensor& t : tensors) tensors_c.push_back(t.contiguous());
  PACKD_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(index));
  PACKD_RETURN_IF_ERROR(EncodePack(
      absl::StrCat("uuid:", uuid), pack, tensors_c, mask_c,
      pack.segment_ids.defined() ? pack.segment_ids.contiguous() : at::Tensor(),
      GpuEncoder(index), request->mutable_batch(), outgoing));
  if (options.loss_mask.defined()) {
    PACKD_RETURN_IF_ERROR(EncodeGpuTensor(options.loss_mask.contiguous(), index,
                                          request->mutable_loss_mask(),
                                          outgoing));
  }
  if (arena > 0) {
    PACKD_ASSIGN_OR_RETURN(gpu_arena,
                           device_memory_->Empty({arena}, at::kByte, index));
    PACKD_ASSIGN_OR_RETURN(*request->mutable_outputs(),
                           GpuSlice(gpu_arena, index, outgoing));
    gpu_arena_offset = static_cast<int64_t>(request->outputs().offset());
  }
  // The inputs written and the arena's memory free before packd touches
  // them.
  PACKD_RETURN_IF_ERROR(device_memory_->Synchronize(index));
  // The arena lives as long as the reader, and each view of it as long as its
  // tensor.
  return StepResults([this, index, gpu_arena, gpu_arena_offset](
                         const Tensors& got, const WireMessage& reply)
                         -> absl::StatusOr<std::vector<at::Tensor>> {
    std::vector<at::Tensor> out;
    for (const v1::Tensor& t : got) {
      if (!t.has_region()) {
        PACKD_ASSIGN_OR_RETURN(at::Tensor host,
                               DecodeResult(t, /*copy_out=*/true, reply));
        PACKD_ASSIGN_OR_RETURN(at::Tensor placed,
                               device_memory_->ToDevice(host, index));
        out.push_back(std::move(placed));
        continue;
      }
      const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
      const at::ScalarType dtype = ToScalarType(static_cast<DType>(t.dtype()));
      const int64_t begin =
          static_cast<int64_t>(t.region().offset()) - gpu_arena_offset;
      const int64_t n = static_cast<int64_t>(t.region().byte_size());
      if (n == 0) {
        PACKD_ASSIGN_OR_RETURN(at::Tensor empty,
                               device_memory_->Empty(shape, dtype, index));
        out.push_back(std::move(empty));
        continue;
      }
      if (!gpu_arena.defined() || begin < 0 || begin + n > gpu_arena.numel()) {
        return absl::InternalError(absl::StrCat(
            "packd wrote a result at ", begin, "..", begin + n,
            ", outside the step's arena of ",
            gpu_arena.defined() ? gpu_arena.numel() : 0, " bytes"));
      }
      out.push_back(gpu_arena.narrow(0, begin, n).view(dtype).reshape(shape));
    }
    return out;
  });
}

}  // namespace packd
