// PackServiceImpl: the packd.v1.PackService RPCs on the gRPC callback API,
// the gRPC face of ServiceCore (service/service_core.h), which does their work.
// Pack and Scatter are served by a generic handler (raw_methods(): its
// reactors, server/pack_scatter_reactor.h, are handed what they use, a
// ReactorEnvironment) that reads a request only once the memory budget admits
// the call; the request is read from the received slices with tensor bytes in
// place (proto/wire.h), decoded (service/request_decoder.h), run by the op
// library on its device (kernels/pack.h), and answered with slices that wrap
// the result buffers, or with results written into region slices.
// PackMicroBatches, a training step (service/step.h), is served the same way
// and answers with a stream: the plan, then each micro-batch packed. The wire
// format is the protobuf one: plain protobuf clients cannot tell. Region RPCs
// go to the RegionRegistry (service/regions.h). Every RPC goes through one call
// mechanism (server/rpc_runner.h: authentication, admission under the drain,
// the guard, metrics, and packd's worker pool, where every handler runs); the
// handlers here only translate between protobuf and the op library.
//
// clang-format off
//   PackServiceImpl service(ServiceOptions{.default_device = Device::Cpu()});
//   builder.RegisterService(&service);
//   builder.RegisterCallbackGenericService(service.raw_methods());
//   // the service's own work, without gRPC:
//   service.core().DoPack(request, &response);
// clang-format on
#ifndef PACKD_SERVER_PACK_SERVICE_H_
#define PACKD_SERVER_PACK_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "server/auth.h"
#include "server/budgeted_reactor.h"
#include "server/rpc_runner.h"
#include "service/memory_budget.h"
#include "service/service_core.h"
#include "service/step_registry.h"

namespace packd {

// What only the gRPC face knows: who a call comes from, and the threads its
// handlers run on.
struct RpcOptions {
  // Bearer tokens every PackService call must carry (--auth_token_file);
  // nullptr: none.
  std::shared_ptr<TokenAuth> auth;
  // The uid of a unix-socket connection packd accepted itself, by the peer
  // gRPC reports for it ("fd:N"), for tenants named by uid (PackdServer sets
  // it); empty: none.
  std::function<std::optional<uid_t>(const std::string& peer)> peer_uid;
  // Worker threads every call's handler runs on (--threads); 0: the hardware
  // threads.
  int worker_threads = 0;
};

// Safe to share across threads, as gRPC requires of a service: its state is
// ServiceCore's and the step registry's, each safe to share.
class PackServiceImpl final
    : public v1::PackService::WithGenericMethod_Pack<
          v1::PackService::WithGenericMethod_Scatter<
              v1::PackService::WithGenericMethod_PackMicroBatches<
                  v1::PackService::CallbackService>>> {
 public:
  explicit PackServiceImpl(ServiceOptions options, RpcOptions rpc = {});
  // Ends the streaming steps still open, so that none holds the memory
  // budget's bytes past it.
  ~PackServiceImpl();

  // From now on, Pack, Scatter, PlanMicroBatches and PackMicroBatches calls
  // get UNAVAILABLE; calls already admitted finish.
  void StartDraining();
  // Waits until no admitted call is running or `deadline` passes. Returns true
  // when none is.
  bool WaitForIdle(absl::Time deadline);

  // Pack, Scatter and PackMicroBatches (packd.v1 messages as raw bytes), and
  // UNIMPLEMENTED for any method no service has: register it beside the
  // service.
  grpc::CallbackGenericService* raw_methods() { return &raw_methods_; }
  grpc::ServerUnaryReactor* RegisterSystemRegion(
      grpc::CallbackServerContext* context,
      const v1::RegisterSystemRegionRequest* request,
      v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* RegisterDeviceRegion(
      grpc::CallbackServerContext* context,
      const v1::RegisterDeviceRegionRequest* request,
      v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(
      grpc::CallbackServerContext* context,
      const v1::UnregisterRegionRequest* request,
      v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(
      grpc::CallbackServerContext* context,
      const v1::ListRegionsRequest* request,
      v1::ListRegionsResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const v1::GetServerInfoRequest* request,
      v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* PlanMicroBatches(
      grpc::CallbackServerContext* context, const v1::PlanRequest* request,
      v1::PlanResponse* response) override;

  // The streaming step (docs/design.md §18): the controller's stream, a
  // submitter's group, a rank's receiving stream.
  grpc::ServerBidiReactor<v1::StepControl, v1::StepEvent>* OpenStep(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* SubmitGroup(
      grpc::CallbackServerContext* context,
      const v1::SubmitGroupRequest* request,
      v1::SubmitGroupResponse* response) override;
  grpc::ServerWriteReactor<v1::PackMicroBatchesResponse>* ReceiveStep(
      grpc::CallbackServerContext* context,
      const v1::ReceiveStepRequest* request) override;
  // The streaming steps open here, and where callers reach them.
  StepRegistry& steps() { return steps_; }

  // What /metrics serves: the calls served so far and the state now.
  std::shared_ptr<prometheus::Collectable> metrics() {
    return core_.metrics().collectable();
  }

  // The service without its transport: Pack, Scatter and the plan of plain
  // messages (the start-up self-check packs through it), regions, metrics.
  ServiceCore& core() { return core_; }

 private:
  // Makes the reactor of each Pack, Scatter and PackMicroBatches call, handing
  // it the service's ReactorEnvironment and, for Pack and Scatter, the handler.
  class RawMethods final : public grpc::CallbackGenericService {
   public:
    explicit RawMethods(PackServiceImpl* service) : service_(service) {}
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override;

   private:
    PackServiceImpl* const service_;
  };

  ServiceCore core_;
  StepRegistry steps_{&core_, &budget_};
  // After the state its handlers use: its workers finish what was submitted
  // before the rest goes.
  RpcRunner calls_;
  // Destroyed before the calls: its waiting calls finish while the rest is
  // alive.
  MemoryBudget budget_;
  // What the raw methods' reactors use of all the above.
  const ReactorEnvironment env_;
  RawMethods raw_methods_{this};
};

}  // namespace packd

#endif  // PACKD_SERVER_PACK_SERVICE_H_
