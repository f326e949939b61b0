#include "server/pack_service.h"

#include <unistd.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"
#include "server/tensor_codec.h"

#ifndef PACKD_VERSION
#define PACKD_VERSION "unknown"
#endif

namespace packd {
namespace {

// A field's decoded inline tensors, named as the request names them
// ("inputs[2]").
absl::StatusOr<std::vector<TensorView>> DecodeAll(
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
    absl::string_view field) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (int i = 0; i < tensors.size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(
        TensorView v,
        DecodeInlineTensor(tensors[i], absl::StrCat(field, "[", i, "]")));
    views.push_back(std::move(v));
  }
  return views;
}

absl::Status NoHandles(int outputs) {
  if (outputs == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "outputs names region slices, but tensor handles are not enabled on "
      "this server; leave outputs empty to get results inline");
}

// Writes result i into the i-th tensor of a response field, sized once the mask
// scan has counted the active rows: the kernels write packed bytes straight
// into the response. The running total is checked against the message limit
// first.
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
    grpc::CallbackServerContext* context, Work&& work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Admit()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "packd is shutting down; retry on another "
                                 "replica"));
    return reactor;
  }
  if (options_.testonly_call_delay > absl::ZeroDuration()) {
    absl::SleepFor(options_.testonly_call_delay);
  }
  const absl::Status status = work();
  Release();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::StatusOr<Device> PackServiceImpl::ResolveDevice(
    const std::string& text) const {
  if (text.empty()) return options_.default_device;
  PACKD_ASSIGN_OR_RETURN(Device device, ParseDevice(text, "device"));
  if (device.kind != DeviceKind::kCpu) {
    // Inline tensors arrive in host memory; other devices need their backend.
    PACKD_RETURN_IF_ERROR(Registry::Get("pack", device).status());
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device.ToString(),
                     " cannot take inline tensors on this server yet"));
  }
  return device;
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

absl::Status PackServiceImpl::DoPack(const v1::PackRequest& request,
                                     v1::PackResponse* response) {
  PACKD_RETURN_IF_ERROR(CheckSize("request", request.ByteSizeLong()));
  PACKD_ASSIGN_OR_RETURN(Device device, ResolveDevice(request.device()));
  PACKD_RETURN_IF_ERROR(NoHandles(request.outputs_size()));
  if (!request.has_mask()) {
    return absl::InvalidArgumentError("mask is missing: give a [B, S] tensor");
  }
  PACKD_ASSIGN_OR_RETURN(TensorView mask,
                         DecodeInlineTensor(request.mask(), "mask"));
  PACKD_ASSIGN_OR_RETURN(std::vector<TensorView> inputs,
                         DecodeAll(request.inputs(), "inputs"));
  mask.device = device;
  for (TensorView& v : inputs) v.device = device;

  PackOptions options;
  options.with_position_ids = request.with_position_ids();
  // Room for cu_seqlens and last_index (at most 10 bytes per varint).
  const int64_t metadata =
      mask.shape.size() == 2 ? 20 * (mask.shape[0] + 1) : 0;
  options.allocate = IntoResponse(response->mutable_packed(),
                                  options_.max_message_bytes, metadata);
  PACKD_ASSIGN_OR_RETURN(PackResult result,
                         ::packd::Pack(mask, inputs, options));

  for (size_t i = 0; i < result.packed.size(); ++i) {
    EncodeTensorHeader(result.packed[i].view, response->mutable_packed(i));
  }
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
  PACKD_RETURN_IF_ERROR(CheckSize("request", request.ByteSizeLong()));
  PACKD_ASSIGN_OR_RETURN(Device device, ResolveDevice(request.device()));
  PACKD_RETURN_IF_ERROR(NoHandles(request.outputs_size()));
  if (!request.has_mask()) {
    return absl::InvalidArgumentError("mask is missing: give a [B, S] tensor");
  }
  PACKD_ASSIGN_OR_RETURN(TensorView mask,
                         DecodeInlineTensor(request.mask(), "mask"));
  PACKD_ASSIGN_OR_RETURN(std::vector<TensorView> packed,
                         DecodeAll(request.packed(), "packed"));
  mask.device = device;
  for (TensorView& v : packed) v.device = device;

  ScatterOptions options;
  if (request.has_tail_shape()) {
    options.tail_shape.emplace(request.tail_shape().dims().begin(),
                               request.tail_shape().dims().end());
  }
  options.allocate =
      IntoResponse(response->mutable_dense(), options_.max_message_bytes, 0);
  PACKD_ASSIGN_OR_RETURN(ScatterResult result,
                         ::packd::Scatter(mask, packed, options));
  for (size_t i = 0; i < result.dense.size(); ++i) {
    EncodeTensorHeader(result.dense[i].view, response->mutable_dense(i));
  }
  absl::Status size = CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

grpc::ServerUnaryReactor* PackServiceImpl::Pack(
    grpc::CallbackServerContext* context, const v1::PackRequest* request,
    v1::PackResponse* response) {
  return Serve(context, [&] { return DoPack(*request, response); });
}

grpc::ServerUnaryReactor* PackServiceImpl::Scatter(
    grpc::CallbackServerContext* context, const v1::ScatterRequest* request,
    v1::ScatterResponse* response) {
  return Serve(context, [&] { return DoScatter(*request, response); });
}

namespace {

grpc::ServerUnaryReactor* Unimplemented(grpc::CallbackServerContext* context,
                                        const char* rpc) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status(
      grpc::StatusCode::UNIMPLEMENTED,
      absl::StrCat(rpc,
                   ": tensor handles (regions) are not available in this "
                   "version of packd; send tensors inline")));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* PackServiceImpl::RegisterSystemRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterSystemRegionRequest*, v1::RegisterRegionResponse*) {
  return Unimplemented(context, "RegisterSystemRegion");
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterDeviceRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterDeviceRegionRequest*, v1::RegisterRegionResponse*) {
  return Unimplemented(context, "RegisterDeviceRegion");
}

grpc::ServerUnaryReactor* PackServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest*,
    v1::UnregisterRegionResponse*) {
  return Unimplemented(context, "UnregisterRegion");
}

grpc::ServerUnaryReactor* PackServiceImpl::ListRegions(
    grpc::CallbackServerContext* context, const v1::ListRegionsRequest*,
    v1::ListRegionsResponse*) {
  return Unimplemented(context, "ListRegions");
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
  response->set_default_device(options_.default_device.ToString());
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_shared_memory_enabled(false);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace packd
