#include "server/pack_service.h"

#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "kernels/device_runtime.h"
#include "kernels/pack.h"
#include "kernels/pack_sizes.h"
#include "kernels/registry.h"
#include "planner/planner.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"
#include "server/inline_call.h"
#include "server/pack_reply.h"
#include "server/step.h"
#include "server/step_call.h"

#ifndef PACKD_VERSION
#define PACKD_VERSION "unknown"
#endif

namespace packd {
PackServiceImpl::PackServiceImpl(ServiceOptions options)
    : options_(std::move(options)),
      regions_(options_.regions),
      decoder_(regions_, options_.default_device, options_.max_message_bytes),
      metrics_(Metrics::Gauges{
          [this] { return calls_.in_flight(); },
          [this] { return budget_.in_use(); },
          [this] { return budget_.limit() > 0 ? budget_.limit() : 0; },
          [this] { return budget_.waiting(); },
          [this](absl::string_view kind) { return regions_.size(kind); },
          [this] { return regions_.expired(); }}),
      calls_(
          CallMechanism::Options{
              options_.auth,
              options_.worker_threads > 0
                  ? options_.worker_threads
                  : static_cast<int>(std::thread::hardware_concurrency()),
              [this] { CheckDefaultDevice(); }},
          &metrics_),
      budget_(options_.max_inflight_bytes),
      env_{&calls_,
           &budget_,
           &decoder_,
           &metrics_,
           options_.max_message_bytes,
           options_.TEST_call_hook} {
  metrics_.AddDevice(options_.default_device);
}

grpc::ServerGenericBidiReactor* PackServiceImpl::InlineCalls::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  PackServiceImpl* const service = service_;
  if (context->method() == "/packd.v1.PackService/Pack") {
    return new InlineCall<v1::PackRequest, v1::PackResponse>(
        &service->env_, context, "Pack",
        [service](const Wire<v1::PackRequest>& request,
                  CallReply<v1::PackResponse>* reply) {
          return service->RunPack(request, reply);
        });
  }
  if (context->method() == "/packd.v1.PackService/PackMicroBatches") {
    return new StepCall(&service->env_, context);
  }
  if (context->method() == "/packd.v1.PackService/Scatter") {
    return new InlineCall<v1::ScatterRequest, v1::ScatterResponse>(
        &service->env_, context, "Scatter",
        [service](const Wire<v1::ScatterRequest>& request,
                  CallReply<v1::ScatterResponse>* reply) {
          return service->RunScatter(request, reply);
        });
  }
  class Unknown final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Unknown(const std::string& method) {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                          absl::StrCat("packd has no method ", method)));
    }
    void OnDone() override { delete this; }
  };
  return new Unknown(context->method());
}

void PackServiceImpl::StartDraining() { calls_.StartDraining(); }

bool PackServiceImpl::WaitForIdle(absl::Time deadline) {
  return calls_.WaitForIdle(deadline);
}

template <typename Request, typename Response, typename Op>
absl::Status PackServiceImpl::RunCall(const char* method,
                                      const Wire<Request>& request,
                                      const ResultSlot& results,
                                      int64_t bytes_per_row,
                                      CallReply<Response>* reply, Op&& op) {
  PACKD_ASSIGN_OR_RETURN(DecodedCall call, decoder_.Decode(request));
  // The decoder has held the mask's rows against the message limit, so this
  // cannot overflow.
  const int64_t reserved = bytes_per_row * (call.mask.shape[0] + 1);
  CallOptions options;
  options.device = call.device;
  options.allocate = call.outputs.empty()
                         ? IntoReply(&reply->response, results, &reply->buffers,
                                     options_.max_message_bytes, reserved)
                         : IntoSlices(&call.outputs);
  if (options_.TEST_call_hook) options_.TEST_call_hook(method);
  absl::StatusOr<std::vector<ResultTensor>> out = op(call, options);
  PACKD_RETURN_IF_ERROR(metrics_.OnDevice(call.device, out.status()));
  EncodeResults(*out, request->outputs(), results);
  return absl::OkStatus();
}

template <typename Request, typename Response, typename Run>
absl::Status PackServiceImpl::RunPlain(const Request& request,
                                       Response* response, Run&& run) {
  Wire<Request> wire;
  wire.message() = request;
  CallReply<Response> reply;
  PACKD_RETURN_IF_ERROR(run(wire, &reply));
  reply.response.CopyPayloadsIntoData();
  *response = std::move(reply.response.message());
  absl::Status size = decoder_.CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

absl::Status PackServiceImpl::DoPack(const v1::PackRequest& request,
                                     v1::PackResponse* response) {
  return RunPlain(request, response, [this](const auto& wire, auto* reply) {
    return RunPack(wire, reply);
  });
}

absl::Status PackServiceImpl::DoScatter(const v1::ScatterRequest& request,
                                        v1::ScatterResponse* response) {
  return RunPlain(request, response, [this](const auto& wire, auto* reply) {
    return RunScatter(wire, reply);
  });
}

absl::Status PackServiceImpl::RunPack(const Wire<v1::PackRequest>& wire,
                                      CallReply<v1::PackResponse>* reply) {
  const v1::PackRequest& request = wire.message();
  v1::PackResponse* response = &reply->response.message();
  auto pack = [&](const DecodedCall& call, const CallOptions& base)
      -> absl::StatusOr<std::vector<ResultTensor>> {
    PACKD_ASSIGN_OR_RETURN(
        PackResult result,
        ::packd::Pack(call.tensors, call.mask,
                      PackOptionsOf(request, base, call.segment_ids,
                                    options_.max_message_bytes)));
    return SetPackResponse(std::move(result), response);
  };
  return RunCall("Pack", wire, PackSlots(response, request.inputs_size()),
                 kMetadataBytesPerBatchRow, reply, pack);
}

absl::Status PackServiceImpl::RunScatter(
    const Wire<v1::ScatterRequest>& wire,
    CallReply<v1::ScatterResponse>* reply) {
  const v1::ScatterRequest& request = wire.message();
  auto scatter = [&](const DecodedCall& call, const CallOptions& base)
      -> absl::StatusOr<std::vector<ResultTensor>> {
    ScatterOptions options;
    static_cast<CallOptions&>(options) = base;
    if (request.has_tail_shape()) {
      options.tail_shape.emplace(request.tail_shape().dims().begin(),
                                 request.tail_shape().dims().end());
    }
    options.segment_ids = call.segment_ids;
    options.layout = DecodeLayout(request);
    options.layout.max_rows = MaxEntriesPerMessage(options_.max_message_bytes);
    PACKD_ASSIGN_OR_RETURN(ScatterResult result,
                           ::packd::Scatter(call.tensors, call.mask, options));
    return std::move(result.dense);
  };
  v1::ScatterResponse* response = &reply->response.message();
  auto slot = [response](size_t i) {
    return SlotOf(response->mutable_dense(), i);
  };
  return RunCall("Scatter", wire, slot, 0, reply, scatter);
}

absl::Status PackServiceImpl::DoPlan(const v1::PlanRequest& request,
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

absl::Status PackServiceImpl::TEST_PackMicroBatches(
    const v1::PackMicroBatchesRequest& request,
    std::vector<v1::PackMicroBatchesResponse>* responses) {
  PACKD_RETURN_IF_ERROR(decoder_.CheckSize("request", request.ByteSizeLong()));
  Wire<v1::PackMicroBatchesRequest> wire;
  wire.message() = request;
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<TrainingStep> step,
      TrainingStep::Make(wire, decoder_, options_.max_message_bytes));
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

grpc::ServerUnaryReactor* PackServiceImpl::PlanMicroBatches(
    grpc::CallbackServerContext* context, const v1::PlanRequest* request,
    v1::PlanResponse* response) {
  return calls_.Unary(context, "PlanMicroBatches", Draining::kRefused, *request,
                      response, [=] { return DoPlan(*request, response); });
}

void PackServiceImpl::CheckDefaultDevice() {
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

grpc::ServerUnaryReactor* PackServiceImpl::RegisterSystemRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterSystemRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterSystemRegion", Draining::kServed,
                      *request, response, [=] {
                        return regions_.RegisterSystem(
                            request->name(), request->key(), request->offset(),
                            request->byte_size(), request->lease_seconds());
                      });
}

absl::Status PackServiceImpl::DoRegisterDeviceRegion(
    const v1::RegisterDeviceRegionRequest& request) {
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
                         regions_.HeldAs(request.name(), identity));
  if (held) return absl::OkStatus();
  PACKD_ASSIGN_OR_RETURN(DeviceRuntime * runtime, Registry::Runtime(device));
  PACKD_ASSIGN_OR_RETURN(DeviceMapping mapping,
                         runtime->OpenIpcMemory(request.ipc_handle(), device,
                                                request.byte_size()));
  return regions_.RegisterDevice(request.name(), device,
                                 static_cast<char*>(mapping.base),
                                 request.byte_size(), std::move(mapping.owner),
                                 request.lease_seconds(), std::move(identity));
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterDeviceRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterDeviceRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterDeviceRegion", Draining::kServed,
                      *request, response,
                      [=] { return DoRegisterDeviceRegion(*request); });
}

grpc::ServerUnaryReactor* PackServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* context,
    const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* response) {
  return calls_.Unary(context, "UnregisterRegion", Draining::kServed, *request,
                      response,
                      [=] { return regions_.Unregister(request->name()); });
}

grpc::ServerUnaryReactor* PackServiceImpl::ListRegions(
    grpc::CallbackServerContext* context, const v1::ListRegionsRequest* request,
    v1::ListRegionsResponse* response) {
  return calls_.Unary(context, "ListRegions", Draining::kServed, *request,
                      response, [=] {
                        PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
                        for (v1::RegionInfo& info : regions_.List()) {
                          *response->add_regions() = std::move(info);
                        }
                        return absl::OkStatus();
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context,
    const v1::GetServerInfoRequest* request, v1::ServerInfo* response) {
  return calls_.Unary(context, "GetServerInfo", Draining::kServed, *request,
                      response, [=] { return DoServerInfo(response); });
}

absl::Status PackServiceImpl::DoServerInfo(v1::ServerInfo* response) {
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
  return absl::OkStatus();
}

}  // namespace packd
