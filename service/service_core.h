// ServiceCore: packd's PackService without its transport: the region
// registry, the request decoder, the metrics and the one form in which every
// Pack and Scatter is served (Serve, from the call's CallSpec), beside the
// plan, the server's facts, the region RPCs' work and a step's messages, each
// callable without gRPC. PackServiceImpl (server/pack_service.h) is its gRPC
// face; nothing here names gRPC.
//
// clang-format off
//   ServiceCore core(ServiceOptions{.default_device = Device::Cpu()}, in_flight, &budget);
//   PACKD_RETURN_IF_ERROR(core.DoPack(request, &response));
// clang-format on
#ifndef PACKD_SERVICE_SERVICE_CORE_H_
#define PACKD_SERVICE_SERVICE_CORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/wire.h"
#include "service/call_spec.h"
#include "service/memory_budget.h"
#include "service/metrics.h"
#include "service/pack_reply.h"
#include "service/regions.h"
#include "service/request_decoder.h"

namespace packd {

struct ServiceOptions {
  Device default_device;
  // Largest request or response, in bytes (--max_message_bytes).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Tensor handles: whether they are enabled, and the shared-memory key prefix.
  RegionOptions regions;
  // Bound on the request and result bytes of inline calls in flight
  // (--max_inflight_bytes, service/memory_budget.h); 0: none.
  int64_t max_inflight_bytes = 0;
  // One tenant's share of it (--max_inflight_bytes_per_tenant); 0: all of it.
  int64_t max_inflight_bytes_per_tenant = 0;
  // Called once, with the reason, when a failed call finds the default device
  // lost (a sticky runtime error: every later call on it fails). PackdServer
  // turns readiness NOT_SERVING.
  std::function<void(const absl::Status& reason)> on_device_lost;

  // Extra options (for testing) that packd itself never sets.
  //
  // Called with the method name ("Pack", "Scatter", "PackMicroBatches") once
  // a call's tensors are decoded (its regions held), before the op runs:
  // tests hold a call in flight with it (packd_testing --call_delay_ms).
  std::function<void(absl::string_view method)> TEST_call_hook;
};

// Safe to share across threads: every method may be called from several at
// once.
class ServiceCore {
 public:
  // `calls_in_flight` and `budget` are the transport's, read by the metrics
  // only (they may be made after the core, but must outlive its use).
  ServiceCore(ServiceOptions options, std::function<int64_t()> calls_in_flight,
              const MemoryBudget* budget);

  // The one form every Pack and Scatter call takes, from its spec (made once
  // where its request was parsed): its tensors decoded onto the spec's
  // headers, its results placed (pooled buffers that `reply` carries, after
  // the spec's reserve for metadata out of --max_message_bytes, or the
  // request's output slices), the op run with the spec's options, and the
  // result headers encoded.
  template <typename Request, typename Response>
  absl::Status Serve(const CallSpec& spec, const Wire<Request>& request,
                     CallReply<Response>* reply);

  // Pack, Scatter and the plan of plain messages (the start-up self-check
  // uses DoPack), with inline results copied into the response.
  absl::Status DoPack(const v1::PackRequest& request,
                      v1::PackResponse* response);
  absl::Status DoScatter(const v1::ScatterRequest& request,
                         v1::ScatterResponse* response);
  absl::Status DoPlan(const v1::PlanRequest& request,
                      v1::PlanResponse* response);
  // The server's facts, with `tenant`'s key prefix.
  absl::Status DoServerInfo(const Tenant& tenant, v1::ServerInfo* response);
  // The region RPCs' work, each on `tenant`'s regions only.
  absl::Status DoRegisterSystemRegion(
      const Tenant& tenant, const v1::RegisterSystemRegionRequest& request);
  // Opens the request's IPC handle and registers the mapping as a region.
  absl::Status DoRegisterDeviceRegion(
      const Tenant& tenant, const v1::RegisterDeviceRegionRequest& request);
  absl::Status DoUnregisterRegion(const Tenant& tenant,
                                  const v1::UnregisterRegionRequest& request);
  absl::Status DoListRegions(const Tenant& tenant,
                             v1::ListRegionsResponse* response);
  // After a failed call: whether the default device is lost, and if so, tells
  // on_device_lost (once).
  void CheckDefaultDevice();

  const ServiceOptions& options() const { return options_; }
  const RequestDecoder& decoder() const { return decoder_; }
  Metrics& metrics() { return metrics_; }

  // Extra methods (for testing) that are not part of the service.
  //
  // A PackMicroBatches call's messages, in order (the plan, then each
  // micro-batch, each made by TrainingStep::Message as MicroBatchesReactor
  // makes it), without gRPC: the fuzz target's way in.
  absl::Status TEST_PackMicroBatches(
      const v1::PackMicroBatchesRequest& request,
      std::vector<v1::PackMicroBatchesResponse>* responses);

 private:
  // Serve of a plain message: the request copied into a WireMessage, the
  // inline results copied into the response's data fields, and the
  // response's size checked.
  template <typename Request, typename Response>
  absl::Status ServePlain(const Request& request, Response* response);

  const ServiceOptions options_;
  RegionRegistry regions_;
  const RequestDecoder decoder_;
  Metrics metrics_;
  mutable absl::Mutex mu_;
  bool device_lost_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace packd

#endif  // PACKD_SERVICE_SERVICE_CORE_H_
