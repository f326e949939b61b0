#include "server/pack_service.h"

#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/micro_batches_reactor.h"
#include "server/pack_scatter_reactor.h"
#include "server/stream_step_reactors.h"

namespace packd {

PackServiceImpl::PackServiceImpl(ServiceOptions options, RpcOptions rpc)
    : core_(
          std::move(options), [this] { return calls_.in_flight(); }, &budget_),
      calls_(RpcRunner::Options{std::move(rpc.auth), std::move(rpc.peer_uid),
                                rpc.worker_threads > 0
                                    ? rpc.worker_threads
                                    : static_cast<int>(
                                          std::thread::hardware_concurrency()),
                                [this] { core_.CheckDefaultDevice(); }},
             &core_.metrics()),
      budget_(core_.options().max_inflight_bytes,
              core_.options().max_inflight_bytes_per_tenant),
      env_{&calls_,
           &budget_,
           &core_.decoder(),
           &core_.metrics(),
           core_.options().max_message_bytes,
           core_.options().TEST_call_hook} {}

grpc::ServerGenericBidiReactor* PackServiceImpl::RawMethods::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  PackServiceImpl* const service = service_;
  if (context->method() == "/packd.v1.PackService/Pack") {
    return new PackScatterReactor<v1::PackRequest, v1::PackResponse>(
        &service->env_, context, "Pack",
        [service](const Wire<v1::PackRequest>& request, const CallSpec& spec,
                  CallReply<v1::PackResponse>* reply) {
          return service->core_.Serve(spec, request, reply);
        });
  }
  if (context->method() == "/packd.v1.PackService/PackMicroBatches") {
    return new MicroBatchesReactor(&service->env_, context);
  }
  if (context->method() == "/packd.v1.PackService/Scatter") {
    return new PackScatterReactor<v1::ScatterRequest, v1::ScatterResponse>(
        &service->env_, context, "Scatter",
        [service](const Wire<v1::ScatterRequest>& request, const CallSpec& spec,
                  CallReply<v1::ScatterResponse>* reply) {
          return service->core_.Serve(spec, request, reply);
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

PackServiceImpl::~PackServiceImpl() { steps_.EndAll(); }

void PackServiceImpl::StartDraining() { calls_.StartDraining(); }

bool PackServiceImpl::WaitForIdle(absl::Time deadline) {
  return calls_.WaitForIdle(deadline);
}

grpc::ServerUnaryReactor* PackServiceImpl::PlanMicroBatches(
    grpc::CallbackServerContext* context, const v1::PlanRequest* request,
    v1::PlanResponse* response) {
  return calls_.Unary(
      context, "PlanMicroBatches", Draining::kRefused, *request, response,
      [=](const Tenant&) { return core_.DoPlan(*request, response); });
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterSystemRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterSystemRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterSystemRegion", Draining::kServed,
                      *request, response, [=](const Tenant& tenant) {
                        return core_.DoRegisterSystemRegion(tenant, *request);
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterDeviceRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterDeviceRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterDeviceRegion", Draining::kServed,
                      *request, response, [=](const Tenant& tenant) {
                        return core_.DoRegisterDeviceRegion(tenant, *request);
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* context,
    const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* response) {
  return calls_.Unary(context, "UnregisterRegion", Draining::kServed, *request,
                      response, [=](const Tenant& tenant) {
                        return core_.DoUnregisterRegion(tenant, *request);
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::ListRegions(
    grpc::CallbackServerContext* context, const v1::ListRegionsRequest* request,
    v1::ListRegionsResponse* response) {
  return calls_.Unary(context, "ListRegions", Draining::kServed, *request,
                      response, [=](const Tenant& tenant) {
                        return core_.DoListRegions(tenant, response);
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context,
    const v1::GetServerInfoRequest* request, v1::ServerInfo* response) {
  return calls_.Unary(context, "GetServerInfo", Draining::kServed, *request,
                      response, [=](const Tenant& tenant) {
                        return core_.DoServerInfo(tenant, response);
                      });
}

grpc::ServerBidiReactor<v1::StepControl, v1::StepEvent>*
PackServiceImpl::OpenStep(grpc::CallbackServerContext* context) {
  return new OpenStepReactor(&calls_, &steps_, context);
}

grpc::ServerUnaryReactor* PackServiceImpl::SubmitGroup(
    grpc::CallbackServerContext* context, const v1::SubmitGroupRequest* request,
    v1::SubmitGroupResponse* response) {
  return calls_.Unary(
      context, "SubmitGroup", Draining::kRefused, *request, response,
      [=](const Tenant& tenant) -> absl::Status {
        PACKD_ASSIGN_OR_RETURN(
            std::shared_ptr<StreamingStep> step,
            steps_.Find(tenant, request->step_id(), StepAccess::kSubmit));
        return step->Submit(tenant, *request, response);
      });
}

grpc::ServerWriteReactor<v1::PackMicroBatchesResponse>*
PackServiceImpl::ReceiveStep(grpc::CallbackServerContext* context,
                             const v1::ReceiveStepRequest* request) {
  return new ReceiveStepReactor(&calls_, &steps_, context, request);
}

}  // namespace packd
