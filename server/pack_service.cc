#include "server/pack_service.h"

#include <unistd.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"
#include "server/device_staging.h"
#include "server/tensor_codec.h"

#ifndef PACKD_VERSION
#define PACKD_VERSION "unknown"
#endif

namespace packd {
namespace {

// Writes result i into the i-th tensor of a response field, sized once the
// mask scan has counted the active rows: the kernels write packed bytes
// straight into the response. The running total is checked against the
// message limit first.
template <typename Field>
OutputAllocator IntoResponse(Field* field, int64_t limit, int64_t reserved) {
  return [field, limit, used = reserved](
             size_t index, int64_t bytes) mutable -> absl::StatusOr<void*> {
    used += bytes;
    if (used > limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the response would hold at least ", used,
          " bytes, over the server's limit of ", limit,
          " bytes (--max_message_bytes); split the batch or use tensor "
          "handles"));
    }
    while (field->size() <= static_cast<int>(index)) field->Add();
    std::string* data = (*field)[index].mutable_data();
    data->resize(bytes);
    return bytes == 0 ? nullptr : static_cast<void*>(data->data());
  };
}

// Host views as they will be once staged to `device` (device-region views are
// there already), for validating before anything moves.
TensorView OnDevice(TensorView view, const Device& device) {
  if (view.device.kind == DeviceKind::kCpu) view.device = device;
  return view;
}
std::vector<TensorView> OnDevice(std::vector<TensorView> views,
                                 const Device& device) {
  for (TensorView& v : views) v = OnDevice(v, device);
  return views;
}

}  // namespace

void PackServiceImpl::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool PackServiceImpl::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

bool PackServiceImpl::Admit() {
  absl::MutexLock lock(&mu_);
  if (draining_) return false;
  ++in_flight_;
  return true;
}

void PackServiceImpl::Release() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

template <typename Work>
grpc::ServerUnaryReactor* PackServiceImpl::Serve(
    grpc::CallbackServerContext* context, const char* method,
    const google::protobuf::Message& request,
    const google::protobuf::Message& response, Work&& work) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = absl::UnavailableError(
      "packd is shutting down; retry on another replica");
  if (Admit()) {
    status = work();
    Release();
  }
  metrics_.Record(method, status.code(), absl::Now() - start,
                  request.ByteSizeLong(),
                  status.ok() ? response.ByteSizeLong() : 0);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* PackServiceImpl::Finish(
    grpc::CallbackServerContext* context, const char* method, absl::Time start,
    const absl::Status& status) {
  metrics_.Record(method, status.code(), absl::Now() - start, 0, 0);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string PackServiceImpl::RenderMetrics() const {
  int64_t in_flight = 0;
  {
    absl::MutexLock lock(&mu_);
    in_flight = in_flight_;
  }
  return metrics_.Render(regions_.enabled() ? regions_.List().size() : 0,
                         in_flight);
}

void PackServiceImpl::TestonlyDelay() const {
  if (options_.testonly_call_delay > absl::ZeroDuration()) {
    absl::SleepFor(options_.testonly_call_delay);
  }
}

absl::StatusOr<Device> PackServiceImpl::ResolveDevice(
    const std::string& text) const {
  if (text.empty()) return options_.default_device;
  PACKD_ASSIGN_OR_RETURN(Device device, ParseDevice(text, "device"));
  // FAILED_PRECONDITION here when the build or the machine lacks the device.
  PACKD_RETURN_IF_ERROR(Registry::Get("pack", device).status());
  return device;
}

absl::StatusOr<std::unique_ptr<DeviceStaging>> PackServiceImpl::Stage(
    const Device& device, TensorView* mask, std::vector<TensorView>* tensors,
    const std::vector<ResolvedSlice>& slices, OutputAllocator* allocate) const {
  if (device.kind == DeviceKind::kCpu) return nullptr;
  PACKD_ASSIGN_OR_RETURN(Backend * backend, Registry::Get("pack", device));
  // On the heap: the wrapped allocator refers to it.
  auto staging = std::make_unique<DeviceStaging>(backend, device);
  PACKD_RETURN_IF_ERROR(staging->Upload(mask));
  for (TensorView& t : *tensors) PACKD_RETURN_IF_ERROR(staging->Upload(&t));
  *allocate = staging->Wrap(std::move(*allocate), [&slices](size_t i) {
    return slices.empty() ||
           slices[i].region->device().kind == DeviceKind::kCpu;
  });
  return staging;
}

absl::Status PackServiceImpl::CheckSize(const char* what, size_t bytes) const {
  if (static_cast<int64_t>(bytes) <= options_.max_message_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the ", what, " is ", bytes, " bytes, over the server's limit of ",
      options_.max_message_bytes,
      " bytes (--max_message_bytes); split the batch or use tensor handles"));
}

template <typename Request>
absl::StatusOr<PackServiceImpl::DecodedCall> PackServiceImpl::Decode(
    const Request& request,
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
    absl::string_view field) const {
  PACKD_RETURN_IF_ERROR(CheckSize("request", request.ByteSizeLong()));
  DecodedCall call;
  PACKD_ASSIGN_OR_RETURN(call.device, ResolveDevice(request.device()));
  if (!request.has_mask()) {
    return absl::InvalidArgumentError("mask is missing: give a [B, S] tensor");
  }
  PACKD_ASSIGN_OR_RETURN(
      call.mask, DecodeTensor(request.mask(), "mask", &regions_, &call.held));
  call.tensors.reserve(tensors.size());
  for (int i = 0; i < tensors.size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(
        TensorView v, DecodeTensor(tensors[i], absl::StrCat(field, "[", i, "]"),
                                   &regions_, &call.held));
    call.tensors.push_back(std::move(v));
  }
  return call;
}

template <typename Field>
absl::StatusOr<OutputAllocator> PackServiceImpl::ResultPlacement(
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
    int num_results, Field* inline_results, int64_t reserved,
    std::vector<ResolvedSlice>* slices) const {
  if (outputs.empty()) {
    return IntoResponse(inline_results, options_.max_message_bytes, reserved);
  }
  if (outputs.size() != num_results) {
    return absl::InvalidArgumentError(absl::StrCat(
        "outputs has ", outputs.size(), " slices but there are ", num_results,
        " tensors: give one slice per tensor, or none for inline results"));
  }
  for (int i = 0; i < outputs.size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(
        ResolvedSlice slice,
        regions_.Resolve(outputs[i], absl::StrCat("outputs[", i, "]")));
    slices->push_back(std::move(slice));
  }
  return OutputAllocator(
      [slices](size_t i, int64_t bytes) -> absl::StatusOr<void*> {
        const ResolvedSlice& slice = (*slices)[i];
        if (static_cast<uint64_t>(bytes) > slice.byte_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("outputs[", i, "] has ", slice.byte_size,
                           " bytes but the result needs ", bytes, " bytes"));
        }
        return static_cast<void*>(slice.data);
      });
}

template <typename Field>
void PackServiceImpl::EncodeResults(
    const std::vector<Tensor>& results,
    const std::vector<ResolvedSlice>& slices,
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
    Field* field) const {
  for (size_t i = 0; i < results.size(); ++i) {
    while (field->size() <= static_cast<int>(i)) field->Add();
    v1::Tensor* out = &(*field)[i];
    EncodeTensorHeader(results[i].view, out);
    if (!slices.empty()) {
      v1::RegionSlice* written = out->mutable_region();
      written->set_region(outputs[i].region());
      written->set_offset(outputs[i].offset());
      written->set_byte_size(results[i].view.nbytes());
    }
  }
}

absl::Status PackServiceImpl::DoPack(const v1::PackRequest& request,
                                     v1::PackResponse* response) {
  PACKD_ASSIGN_OR_RETURN(DecodedCall call,
                         Decode(request, request.inputs(), "inputs"));
  const Device& device = call.device;
  TensorView& mask = call.mask;
  std::vector<TensorView>& inputs = call.tensors;

  PackOptions options;
  options.with_position_ids = request.with_position_ids();
  // Room for cu_seqlens and last_index (at most 10 bytes per varint).
  const int64_t metadata =
      mask.shape.size() == 2 ? 20 * (mask.shape[0] + 1) : 0;
  std::vector<ResolvedSlice> slices;
  PACKD_ASSIGN_OR_RETURN(
      options.allocate,
      ResultPlacement(request.outputs(), request.inputs_size(),
                      response->mutable_packed(), metadata, &slices));
  PACKD_RETURN_IF_ERROR(
      ValidatePackArgs(OnDevice(mask, device), OnDevice(inputs, device)));
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceStaging> staging,
      Stage(device, &mask, &inputs, slices, &options.allocate));
  TestonlyDelay();
  PACKD_ASSIGN_OR_RETURN(PackResult result,
                         ::packd::Pack(mask, inputs, options));
  if (staging != nullptr) PACKD_RETURN_IF_ERROR(staging->Download());

  EncodeResults(result.packed, slices, request.outputs(),
                response->mutable_packed());
  response->mutable_cu_seqlens()->Assign(result.cu_seqlens.begin(),
                                         result.cu_seqlens.end());
  response->set_total_active(result.total_active);
  response->set_max_seqlen(result.max_seqlen);
  response->mutable_position_ids()->Assign(result.position_ids.begin(),
                                           result.position_ids.end());
  response->mutable_last_index()->Assign(result.last_index.begin(),
                                         result.last_index.end());
  absl::Status size = CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

absl::Status PackServiceImpl::DoScatter(const v1::ScatterRequest& request,
                                        v1::ScatterResponse* response) {
  PACKD_ASSIGN_OR_RETURN(DecodedCall call,
                         Decode(request, request.packed(), "packed"));
  const Device& device = call.device;
  TensorView& mask = call.mask;
  std::vector<TensorView>& packed = call.tensors;

  ScatterOptions options;
  if (request.has_tail_shape()) {
    options.tail_shape.emplace(request.tail_shape().dims().begin(),
                               request.tail_shape().dims().end());
  }
  std::vector<ResolvedSlice> slices;
  PACKD_ASSIGN_OR_RETURN(
      options.allocate,
      ResultPlacement(request.outputs(), request.packed_size(),
                      response->mutable_dense(), 0, &slices));
  PACKD_RETURN_IF_ERROR(ValidateScatterArgs(
      OnDevice(mask, device), OnDevice(packed, device), options.tail_shape));
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceStaging> staging,
      Stage(device, &mask, &packed, slices, &options.allocate));
  TestonlyDelay();
  PACKD_ASSIGN_OR_RETURN(ScatterResult result,
                         ::packd::Scatter(mask, packed, options));
  if (staging != nullptr) PACKD_RETURN_IF_ERROR(staging->Download());
  EncodeResults(result.dense, slices, request.outputs(),
                response->mutable_dense());
  absl::Status size = CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

grpc::ServerUnaryReactor* PackServiceImpl::Pack(
    grpc::CallbackServerContext* context, const v1::PackRequest* request,
    v1::PackResponse* response) {
  return Serve(context, "Pack", *request, *response,
               [&] { return DoPack(*request, response); });
}

grpc::ServerUnaryReactor* PackServiceImpl::Scatter(
    grpc::CallbackServerContext* context, const v1::ScatterRequest* request,
    v1::ScatterResponse* response) {
  return Serve(context, "Scatter", *request, *response,
               [&] { return DoScatter(*request, response); });
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterSystemRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterSystemRegionRequest* request,
    v1::RegisterRegionResponse*) {
  return Finish(
      context, "RegisterSystemRegion", absl::Now(),
      regions_.RegisterSystem(request->name(), request->key(),
                              request->offset(), request->byte_size()));
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterDeviceRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterDeviceRegionRequest* request,
    v1::RegisterRegionResponse*) {
  const absl::Time start = absl::Now();
  auto work = [&]() -> absl::Status {
    PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
    PACKD_RETURN_IF_ERROR(RegionRegistry::ValidateName(request->name()));
    PACKD_ASSIGN_OR_RETURN(Device device, ParseDevice(request->device()));
    if (device.kind == DeviceKind::kCpu) {
      return absl::InvalidArgumentError(
          "device regions live on cuda:N or hip:N; register host memory with "
          "RegisterSystemRegion");
    }
    if (request->ipc_handle().size() != 64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ipc_handle has ", request->ipc_handle().size(),
          " bytes; a cudaIpcMemHandle_t / hipIpcMemHandle_t has 64"));
    }
    if (request->byte_size() == 0) {
      return absl::InvalidArgumentError("byte_size must be positive");
    }
    PACKD_ASSIGN_OR_RETURN(Backend * backend, Registry::Get("pack", device));
    PACKD_ASSIGN_OR_RETURN(DeviceMapping mapping,
                           backend->OpenIpcMemory(request->ipc_handle(), device,
                                                  request->byte_size()));
    return regions_.RegisterDevice(
        request->name(), device, static_cast<char*>(mapping.base),
        request->byte_size(), std::move(mapping.owner));
  };
  return Finish(context, "RegisterDeviceRegion", start, work());
}

grpc::ServerUnaryReactor* PackServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* context,
    const v1::UnregisterRegionRequest* request, v1::UnregisterRegionResponse*) {
  return Finish(context, "UnregisterRegion", absl::Now(),
                regions_.Unregister(request->name()));
}

grpc::ServerUnaryReactor* PackServiceImpl::ListRegions(
    grpc::CallbackServerContext* context, const v1::ListRegionsRequest*,
    v1::ListRegionsResponse* response) {
  if (absl::Status s = regions_.CheckEnabled(); !s.ok()) {
    return Finish(context, "ListRegions", absl::Now(), s);
  }
  for (v1::RegionInfo& info : regions_.List()) {
    *response->add_regions() = std::move(info);
  }
  return Finish(context, "ListRegions", absl::Now(), absl::OkStatus());
}

grpc::ServerUnaryReactor* PackServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest*,
    v1::ServerInfo* response) {
  response->set_version(PACKD_VERSION);
  v1::DeviceInfo* cpu = response->add_devices();
  cpu->set_name("cpu");
  cpu->set_kind("cpu");
  cpu->set_memory_bytes(static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                        static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  for (DeviceKind kind : {DeviceKind::kCuda, DeviceKind::kHip}) {
    for (int i = 0; i < 64; ++i) {
      const Device gpu{kind, i};
      if (!Registry::Get("pack", gpu).ok()) break;
      v1::DeviceInfo* info = response->add_devices();
      info->set_name(gpu.ToString());
      info->set_kind(kind == DeviceKind::kCuda ? "cuda" : "hip");
    }
  }
  response->set_default_device(options_.default_device.ToString());
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_shared_memory_enabled(regions_.enabled());
  return Finish(context, "GetServerInfo", absl::Now(), absl::OkStatus());
}

}  // namespace packd
