// PackServiceImpl: the packd.v1.PackService RPCs on the gRPC callback API.
// Pack and Scatter are served by a generic handler (inline_calls(): its
// reactors, server/inline_call.h, are handed what they use, a CallEnvironment)
// that reads a request only once the memory budget admits the call; the
// request is read
// from the received slices with tensor bytes in place (proto/wire.h), decoded
// (server/request_decoder.h), run by the op library on its device
// (kernels/pack.h), and answered with slices that wrap the result buffers, or
// with results written into region slices. PackMicroBatches, a training step
// (server/step.h), is served the same way and answers with a stream: the plan,
// then each micro-batch packed. The wire format is the protobuf one: plain
// protobuf clients cannot tell. Region RPCs go to the
// RegionRegistry (server/regions.h). Every RPC goes through one call
// mechanism (server/call.h: authentication, admission under the drain, the
// guard, metrics, and packd's worker pool, where every handler runs); the
// handlers here only translate between protobuf and the op library.
//
//   PackServiceImpl service(ServiceOptions{.default_device = Device::Cpu()});
//   builder.RegisterService(&service);
//   builder.RegisterCallbackGenericService(service.inline_calls());
#ifndef PACKD_SERVER_PACK_SERVICE_H_
#define PACKD_SERVER_PACK_SERVICE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/tensor_view.h"
#include "grpcpp/generic/async_generic_service.h"
#include "kernels/pack.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "proto/wire.h"
#include "server/auth.h"
#include "server/budgeted_call.h"
#include "server/call.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/pack_reply.h"
#include "server/regions.h"
#include "server/request_decoder.h"

namespace packd {

struct ServiceOptions {
  Device default_device;
  // Largest request or response, in bytes (--max_message_bytes).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Tensor handles: whether they are enabled, and the shared-memory key prefix.
  RegionOptions regions;
  // Bearer tokens every PackService call must carry (--auth_token_file);
  // nullptr: none.
  std::shared_ptr<TokenAuth> auth;
  // Bound on the request and result bytes of inline calls in flight
  // (--max_inflight_bytes, server/memory_budget.h); 0: none.
  int64_t max_inflight_bytes = 0;
  // Called once, with the reason, when a failed call finds the default device
  // lost (a sticky runtime error: every later call on it fails). PackdServer
  // turns readiness NOT_SERVING.
  std::function<void(const absl::Status& reason)> on_device_lost;
  // Worker threads every call's handler runs on (--threads); 0: the hardware
  // threads.
  int worker_threads = 0;

  // Extra options (for testing) that packd itself never sets.
  //
  // Called with the method name ("Pack", "Scatter", "PackMicroBatches") once
  // a call's tensors are decoded (its regions held), before the op runs:
  // tests hold a call in flight with it (packd_testing --call_delay_ms).
  std::function<void(absl::string_view method)> TEST_call_hook;
};

class PackServiceImpl final
    : public v1::PackService::WithGenericMethod_Pack<
          v1::PackService::WithGenericMethod_Scatter<
              v1::PackService::WithGenericMethod_PackMicroBatches<
                  v1::PackService::CallbackService>>> {
 public:
  explicit PackServiceImpl(ServiceOptions options);

  // From now on, Pack, Scatter, PlanMicroBatches and PackMicroBatches calls
  // get UNAVAILABLE; calls already admitted finish.
  void StartDraining();
  // Waits until no admitted call is running or `deadline` passes. Returns true
  // when none is.
  bool WaitForIdle(absl::Time deadline);

  // Pack, Scatter and PackMicroBatches (packd.v1 messages as raw bytes), and
  // UNIMPLEMENTED for any method no service has: register it beside the
  // service.
  grpc::CallbackGenericService* inline_calls() { return &inline_calls_; }
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

  // What /metrics serves: the calls served so far and the state now.
  std::shared_ptr<prometheus::Collectable> metrics() const {
    return metrics_.collectable();
  }

  // The work behind the RPCs, callable without gRPC (the start-up self-check
  // uses DoPack), with inline results copied into the response.
  absl::Status DoPack(const v1::PackRequest& request,
                      v1::PackResponse* response);
  absl::Status DoScatter(const v1::ScatterRequest& request,
                         v1::ScatterResponse* response);
  absl::Status DoPlan(const v1::PlanRequest& request,
                      v1::PlanResponse* response);

  // Extra methods (for testing) that are not part of the service.
  //
  // A PackMicroBatches call's messages, in order (the plan, then each
  // micro-batch, each made by TrainingStep::Message as StepCall makes it),
  // without gRPC: the fuzz target's way in.
  absl::Status TEST_PackMicroBatches(
      const v1::PackMicroBatchesRequest& request,
      std::vector<v1::PackMicroBatchesResponse>* responses);

 private:
  // Makes the reactor of each Pack, Scatter and PackMicroBatches call, handing
  // it the service's CallEnvironment and, for Pack and Scatter, the handler.
  class InlineCalls final : public grpc::CallbackGenericService {
   public:
    explicit InlineCalls(PackServiceImpl* service) : service_(service) {}
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override;

   private:
    PackServiceImpl* const service_;
  };

  // The steps every Pack and Scatter call takes: decode, place results
  // (pooled buffers that `reply` carries for the response tensors `results`
  // names, or the request's output slices), run `op` with the call's options,
  // and encode the result headers. `bytes_per_row`: response bytes besides
  // the tensors for each row of the mask (the per-row metadata: cu_seqlens,
  // last_index, ...), reserved out of --max_message_bytes.
  template <typename Request, typename Response, typename Op>
  absl::Status RunCall(const char* method, const Wire<Request>& request,
                       const ResultSlot& results, int64_t bytes_per_row,
                       CallReply<Response>* reply, Op&& op);
  absl::Status RunPack(const Wire<v1::PackRequest>& request,
                       CallReply<v1::PackResponse>* reply);
  // `run` (RunPack, RunScatter) of a plain message, for callers without
  // gRPC: the request copied into a WireMessage, the inline results copied
  // into the response's data fields, and the response's size checked.
  template <typename Request, typename Response, typename Run>
  absl::Status RunPlain(const Request& request, Response* response, Run&& run);
  absl::Status RunScatter(const Wire<v1::ScatterRequest>& request,
                          CallReply<v1::ScatterResponse>* reply);
  absl::Status DoServerInfo(v1::ServerInfo* response);
  // After a failed call: whether the default device is lost, and if so, tells
  // on_device_lost (once).
  void CheckDefaultDevice();
  // Opens the request's IPC handle and registers the mapping as a region.
  absl::Status DoRegisterDeviceRegion(
      const v1::RegisterDeviceRegionRequest& request);

  const ServiceOptions options_;
  RegionRegistry regions_;
  const RequestDecoder decoder_;
  Metrics metrics_;
  // After the state its handlers use: its workers finish what was submitted
  // before the rest goes.
  CallMechanism calls_;
  mutable absl::Mutex mu_;
  bool device_lost_ ABSL_GUARDED_BY(mu_) = false;
  // Last: destroyed first, its waiting calls finish while the rest is alive.
  MemoryBudget budget_;
  // What the raw methods' reactors use of all the above.
  const CallEnvironment env_;
  InlineCalls inline_calls_{this};
};

}  // namespace packd

#endif  // PACKD_SERVER_PACK_SERVICE_H_
