#include "service/service_core.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "kernels/device_runtime.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "planner/planner.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"
#include "service/step.h"

#ifndef PACKD_VERSION
#define PACKD_VERSION "unknown"
#endif

namespace packd {

ServiceCore::ServiceCore(ServiceOptions options,
                         std::function<int64_t()> calls_in_flight,
                         const MemoryBudget* budget)
    : options_(std::move(options)),
      regions_(options_.regions),
      decoder_(regions_, options_.default_device, options_.max_message_bytes),
      metrics_(Metrics::Gauges{
          std::move(calls_in_flight), [budget] { return budget->in_use(); },
          [budget] { return budget->limit() > 0 ? budget->limit() : 0; },
          [budget] { return budget->waiting(); },
          [this](absl::string_view kind) { return regions_.size(kind); },
          [this] { return regions_.expired(); }}) {
  metrics_.AddDevice(options_.default_device);
}

namespace {

// The op of a decoded call, run with its spec's options over `base`, its
// metadata put in `response`; returns its result tensors in slot order.
absl::StatusOr<std::vector<ResultTensor>> RunOp(const CallSpec& spec,
                                                const DecodedCall& call,
                                                const CallOptions& base,
                                                v1::PackResponse* response) {
  PACKD_ASSIGN_OR_RETURN(PackResult result,
                         Pack(call.tensors, call.mask,
                              spec.PackOptionsFor(base, call.segment_ids)));
  return SetPackResponse(std::move(result), response);
}
absl::StatusOr<std::vector<ResultTensor>> RunOp(
    const CallSpec& spec, const DecodedCall& call, const CallOptions& base,
    v1::ScatterResponse* /*response*/) {
  PACKD_ASSIGN_OR_RETURN(
      ScatterResult result,
      Scatter(call.tensors, call.mask,
              spec.ScatterOptionsFor(base, call.segment_ids)));
  return std::move(result.dense);
}

// Where a call's results go in its response.
ResultSlot SlotsOf(const CallSpec& spec, v1::PackResponse* response) {
  return PackSlots(response, spec.tensors.size());
}
ResultSlot SlotsOf(const CallSpec& /*spec*/, v1::ScatterResponse* response) {
  return [response](size_t i) { return SlotOf(response->mutable_dense(), i); };
}

}  // namespace

template <typename Request, typename Response>
absl::Status ServiceCore::Serve(const CallSpec& spec,
                                const Wire<Request>& request,
                                CallReply<Response>* reply) {
  PACKD_ASSIGN_OR_RETURN(DecodedCall call, decoder_.Decode(request, spec));
  Response* response = &reply->response.message();
  const ResultSlot results = SlotsOf(spec, response);
  CallOptions options;
  options.device = call.device;
  // The decoder has held the mask's rows against the message limit, so the
  // reserve cannot overflow.
  options.allocate = call.outputs.empty()
                         ? IntoReply(&reply->response, results, &reply->buffers,
                                     options_.max_message_bytes,
                                     spec.ReservedBytes(call.mask.shape[0]))
                         : IntoSlices(&call.outputs);
  if (!call.outputs.empty()) {
    // A slice's place and room do not depend on the result's size.
    options.fixed_place = [&call](size_t i) {
      const ResolvedSlice& slice = call.outputs[i];
      return FixedPlace{OutputPlace{slice.data, slice.region->device()},
                        static_cast<int64_t>(slice.byte_size)};
    };
  }
  if (options_.TEST_call_hook) options_.TEST_call_hook(spec.method());
  absl::StatusOr<std::vector<ResultTensor>> out =
      RunOp(spec, call, options, response);
  PACKD_RETURN_IF_ERROR(metrics_.OnDevice(call.device, out.status()));
  EncodeResults(*out, request->outputs(), results);
  return absl::OkStatus();
}

template <typename Request, typename Response>
absl::Status ServiceCore::ServePlain(const Request& request,
                                     Response* response) {
  Wire<Request> wire;
  wire.message() = request;
  // Without gRPC there is no caller to name: the anonymous tenant.
  const CallSpec spec =
      CallSpec::Of(request, "", options_.max_message_bytes, Tenant());
  CallReply<Response> reply;
  PACKD_RETURN_IF_ERROR(Serve(spec, wire, &reply));
  reply.response.CopyPayloadsIntoData();
  *response = std::move(reply.response.message());
  absl::Status size = decoder_.CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

absl::Status ServiceCore::DoPack(const v1::PackRequest& request,
                                 v1::PackResponse* response) {
  return ServePlain(request, response);
}

absl::Status ServiceCore::DoScatter(const v1::ScatterRequest& request,
                                    v1::ScatterResponse* response) {
  return ServePlain(request, response);
}

absl::Status ServiceCore::DoPlan(const v1::PlanRequest& request,
                                 v1::PlanResponse* response) {
  PACKD_RETURN_IF_ERROR(decoder_.CheckSize("request", request.ByteSizeLong()));
  PACKD_ASSIGN_OR_RETURN(
      Plan plan,
      PlanWithinMessage(LengthsOf(request), LossTokensOf(request),
                        PlanOptionsOf(request), options_.max_message_bytes));
  EncodePlan(plan, response);
  absl::Status size = decoder_.CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

absl::Status ServiceCore::TEST_PackMicroBatches(
    const v1::PackMicroBatchesRequest& request,
    std::vector<v1::PackMicroBatchesResponse>* responses) {
  PACKD_RETURN_IF_ERROR(decoder_.CheckSize("request", request.ByteSizeLong()));
  Wire<v1::PackMicroBatchesRequest> wire;
  wire.message() = request;
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<TrainingStep> step,
      TrainingStep::Make(wire, decoder_, options_.max_message_bytes, Tenant()));
  for (size_t k = 0; k < step->messages(); ++k) {
    Wire<v1::PackMicroBatchesResponse> reply;
    std::vector<Buffer> buffers;
    PACKD_RETURN_IF_ERROR(
        metrics_.OnDevice(step->device(), step->Message(k, &reply, &buffers)));
    reply.CopyPayloadsIntoData();
    PACKD_RETURN_IF_ERROR(
        decoder_.CheckSize("response", reply.message().ByteSizeLong()));
    responses->push_back(std::move(reply.message()));
  }
  return absl::OkStatus();
}

void ServiceCore::CheckDefaultDevice() {
  const absl::Status device =
      Registry::Runtime(options_.default_device).status();
  if (device.code() != absl::StatusCode::kUnavailable) return;
  {
    absl::MutexLock lock(&mu_);
    if (device_lost_) return;
    device_lost_ = true;
  }
  if (options_.on_device_lost) options_.on_device_lost(device);
}

absl::Status ServiceCore::DoRegisterDeviceRegion(
    const Tenant& tenant, const v1::RegisterDeviceRegionRequest& request) {
  PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
  PACKD_RETURN_IF_ERROR(RegionRegistry::ValidateName(request.name()));
  // The UUID names the device whatever either process's index for it.
  PACKD_ASSIGN_OR_RETURN(
      Device device,
      request.device_uuid().empty()
          ? Registry::Global().ResolveDevice(request.device())
          : Registry::Global().FindByUuid(request.device_uuid()));
  if (device.kind == DeviceKind::kCpu) {
    return absl::InvalidArgumentError(
        "device regions live on cuda:N or hip:N; register host memory with "
        "RegisterSystemRegion");
  }
  if (request.ipc_handle().size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_handle has ", request.ipc_handle().size(),
        " bytes; a cudaIpcMemHandle_t / hipIpcMemHandle_t has 64"));
  }
  if (request.byte_size() == 0) {
    return absl::InvalidArgumentError("byte_size must be positive");
  }
  std::string identity = RegionRegistry::DeviceIdentity(
      request.ipc_handle(), device, request.byte_size());
  // A repeat after a lost reply finds its region: no second mapping.
  PACKD_ASSIGN_OR_RETURN(const bool held,
                         regions_.HeldAs(tenant, request.name(), identity));
  if (held) return absl::OkStatus();
  PACKD_ASSIGN_OR_RETURN(DeviceRuntime * runtime, Registry::Runtime(device));
  PACKD_ASSIGN_OR_RETURN(DeviceMapping mapping,
                         runtime->OpenIpcMemory(request.ipc_handle(), device,
                                                request.byte_size()));
  return regions_.RegisterDevice(tenant, request.name(), device,
                                 static_cast<char*>(mapping.base),
                                 request.byte_size(), std::move(mapping.owner),
                                 request.lease_seconds(), std::move(identity));
}

absl::Status ServiceCore::DoServerInfo(const Tenant& tenant,
                                       v1::ServerInfo* response) {
  response->set_version(PACKD_VERSION);
  for (DeviceKind kind :
       {DeviceKind::kCpu, DeviceKind::kCuda, DeviceKind::kHip}) {
    absl::StatusOr<DeviceRuntime*> runtime =
        Registry::Global().FindRuntime(Device{kind, 0});
    if (!runtime.ok()) continue;  // not built in, or no device 0
    for (const DeviceInfo& device : (*runtime)->ListDevices()) {
      v1::DeviceInfo* info = response->add_devices();
      info->set_name(device.device.ToString());
      info->set_kind(kind == DeviceKind::kCpu    ? "cpu"
                     : kind == DeviceKind::kCuda ? "cuda"
                                                 : "hip");
      info->set_memory_bytes(device.memory_bytes);
      info->set_uuid(device.uuid);
    }
  }
  response->set_default_device(options_.default_device.ToString());
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_shared_memory_enabled(regions_.enabled());
  response->set_shm_key_prefix(regions_.KeyPrefix(tenant));
  return absl::OkStatus();
}

absl::Status ServiceCore::DoRegisterSystemRegion(
    const Tenant& tenant, const v1::RegisterSystemRegionRequest& request) {
  return regions_.RegisterSystem(tenant, request.name(), request.key(),
                                 request.offset(), request.byte_size(),
                                 request.lease_seconds());
}

absl::Status ServiceCore::DoUnregisterRegion(
    const Tenant& tenant, const v1::UnregisterRegionRequest& request) {
  return regions_.Unregister(tenant, request.name());
}

absl::Status ServiceCore::DoListRegions(const Tenant& tenant,
                                        v1::ListRegionsResponse* response) {
  PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
  for (v1::RegionInfo& info : regions_.List(tenant)) {
    *response->add_regions() = std::move(info);
  }
  return absl::OkStatus();
}

template absl::Status ServiceCore::Serve(const CallSpec&,
                                         const Wire<v1::PackRequest>&,
                                         CallReply<v1::PackResponse>*);
template absl::Status ServiceCore::Serve(const CallSpec&,
                                         const Wire<v1::ScatterRequest>&,
                                         CallReply<v1::ScatterResponse>*);

}  // namespace packd
