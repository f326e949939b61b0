// DeviceStaging: the host side of a call on cuda:N or hip:N. Tensors in host
// memory are copied to the device before the op runs, and results whose place
// is in host memory are written to device buffers first and copied there
// afterwards. Tensors already on the device are used where they are. Pack()
// and Scatter() own one per call; nothing else stages.
//
//   DeviceStaging staging(runtime, &stream);
//   PACKD_RETURN_IF_ERROR(staging.Upload(&mask));          // now on the device
//   PACKD_ASSIGN_OR_RETURN(void* out, staging.Result(host_place, bytes));
//   ... the op writes `out` ...
//   PACKD_RETURN_IF_ERROR(staging.Download());             // copies queued
//   PACKD_RETURN_IF_ERROR(runtime->Synchronize(stream));
//   staging.Deliver();                                     // host_place filled
#ifndef PACKD_KERNELS_DEVICE_STAGING_H_
#define PACKD_KERNELS_DEVICE_STAGING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/buffer.h"
#include "base/tensor_view.h"
#include "kernels/device_runtime.h"

namespace packd {

class DeviceStaging {
 public:
  // Stages for the stream's device through `runtime` (the device's runtime);
  // both must outlive this object.
  DeviceStaging(DeviceRuntime* runtime, const Stream* stream)
      : runtime_(runtime), stream_(stream) {}
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // Whether a tensor on `device` must be staged: it is in host memory and the
  // call is not.
  bool NeedsStaging(const Device& device) const {
    return device.kind == DeviceKind::kCpu &&
           stream_->device().kind != DeviceKind::kCpu;
  }

  // Tensors of at most this many bytes move through pinned host memory with
  // copies queued on the stream, which the call's one synchronisation
  // completes; larger ones through the runtime's bounded staging, which waits
  // as it goes.
  static constexpr int64_t kQueuedBytes = int64_t{8} << 20;

  // If `view` needs staging, copies it into a pooled device buffer and points
  // `view` at that copy (queued on the stream, or done when it returns).
  // RESOURCE_EXHAUSTED when the device is full; INTERNAL on a runtime
  // failure.
  absl::Status Upload(TensorView* view);

  // Where the op writes a result of `bytes` whose place is `place`: `place`
  // itself when no staging is needed, else a device buffer that Download()
  // copies to `place`. RESOURCE_EXHAUSTED when the device is full.
  absl::StatusOr<void*> Result(void* place, const Device& place_device,
                               int64_t bytes);

  // Copies every staged result towards its host place, after the op's work
  // on the stream: queued into pinned memory for Deliver, or (large ones)
  // done when it returns.
  absl::Status Download();
  // Once the stream is synchronised: the queued results into their places.
  void Deliver();

 private:
  struct Pending {
    void* host;
    const void* device;
    int64_t bytes;
  };
  DeviceRuntime* const runtime_;
  const Stream* const stream_;
  std::vector<Buffer> buffers_;
  std::vector<Pending> pending_;
  // Results on their way: pinned memory (device = its data) for `host`.
  std::vector<Pending> queued_;
};

}  // namespace packd

#endif  // PACKD_KERNELS_DEVICE_STAGING_H_
