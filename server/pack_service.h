// PackServiceImpl: the packd.v1.PackService RPCs on the gRPC callback API. It
// decodes and validates each request, runs the kernels with the request's bytes
// read in place and results written straight into the response, and tracks
// calls in flight so that shutdown can drain them.
//
//   PackServiceImpl service(ServiceOptions{.default_device = Device::Cpu()});
//   builder.RegisterService(&service);
#ifndef PACKD_SERVER_PACK_SERVICE_H_
#define PACKD_SERVER_PACK_SERVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/pack.h"
#include "kernels/tensor_view.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "server/device_staging.h"
#include "server/metrics.h"
#include "server/regions.h"

namespace packd {

struct ServiceOptions {
  Device default_device;
  // Largest request or response, in bytes (--max_message_bytes).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Tensor handles: whether they are enabled, and the shared-memory key prefix.
  RegionOptions regions;
  // Test hook: each Pack and Scatter call waits this long once its tensors are
  // decoded.
  absl::Duration testonly_call_delay = absl::ZeroDuration();
};

class PackServiceImpl final : public v1::PackService::CallbackService {
 public:
  explicit PackServiceImpl(ServiceOptions options)
      : options_(options), regions_(options.regions) {}

  // From now on, Pack and Scatter calls get UNAVAILABLE; calls already admitted
  // finish.
  void StartDraining();
  // Waits until no admitted call is running or `deadline` passes. Returns true
  // when none is.
  bool WaitForIdle(absl::Time deadline);

  grpc::ServerUnaryReactor* Pack(grpc::CallbackServerContext* context,
                                 const v1::PackRequest* request,
                                 v1::PackResponse* response) override;
  grpc::ServerUnaryReactor* Scatter(grpc::CallbackServerContext* context,
                                    const v1::ScatterRequest* request,
                                    v1::ScatterResponse* response) override;
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

  // Prometheus text of the calls served so far.
  std::string RenderMetrics() const;

  // The work behind the RPCs, callable without gRPC (the start-up self-check
  // uses DoPack).
  absl::Status DoPack(const v1::PackRequest& request,
                      v1::PackResponse* response);
  absl::Status DoScatter(const v1::ScatterRequest& request,
                         v1::ScatterResponse* response);

 private:
  // Admits a call unless draining; every admitted call must be released.
  bool Admit();
  void Release();
  // Runs `work` as an admitted call, finishes the reactor with its status and
  // records it in the metrics.
  template <typename Work>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context,
                                  const char* method,
                                  const google::protobuf::Message& request,
                                  const google::protobuf::Message& response,
                                  Work&& work);
  // Finishes a region or info call with `status`, recording it.
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                   const char* method, absl::Time start,
                                   const absl::Status& status);

  // The test hook: holds a decoded call (its regions resolved) in flight.
  void TestonlyDelay() const;
  // For a call on a GPU: copies the host tensors there and wraps `allocate`
  // so that host-bound results are staged; null for a CPU call. The
  // staging must outlive the call's use of `allocate`.
  absl::StatusOr<std::unique_ptr<DeviceStaging>> Stage(
      const Device& device, TensorView* mask, std::vector<TensorView>* tensors,
      const std::vector<ResolvedSlice>& slices,
      OutputAllocator* allocate) const;
  absl::StatusOr<Device> ResolveDevice(const std::string& text) const;
  absl::Status CheckSize(const char* what, size_t bytes) const;

  // A request's device, mask and tensors (of the repeated field `field`),
  // checked and decoded; `held` keeps the regions they live in mapped until the
  // call returns.
  struct DecodedCall {
    Device device;
    TensorView mask;
    std::vector<TensorView> tensors;
    std::vector<std::shared_ptr<Region>> held;
  };
  template <typename Request>
  absl::StatusOr<DecodedCall> Decode(
      const Request& request,
      const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
      absl::string_view field) const;
  // Where results go: region slices named by `outputs`, or the response's
  // inline tensors `inline_results`.
  template <typename Field>
  absl::StatusOr<OutputAllocator> ResultPlacement(
      const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
      int num_results, Field* inline_results, int64_t reserved,
      std::vector<ResolvedSlice>* slices) const;
  // Sets each result tensor's header, and its region when written to one.
  template <typename Field>
  void EncodeResults(
      const std::vector<Tensor>& results,
      const std::vector<ResolvedSlice>& slices,
      const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
      Field* field) const;

  const ServiceOptions options_;
  RegionRegistry regions_;
  Metrics metrics_;
  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace packd

#endif  // PACKD_SERVER_PACK_SERVICE_H_
