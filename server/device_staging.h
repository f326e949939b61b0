// DeviceStaging: for a call on cuda:N or hip:N, moves the call's host tensors
// (inline bytes, system regions) to the device and its results back to host
// memory. Device-region tensors stay where they are: they are packed in place.
//
//   DeviceStaging staging(backend, device);
//   PACKD_RETURN_IF_ERROR(staging.Upload(&mask));
//   options.allocate = staging.Wrap(std::move(options.allocate), is_host);
//   ... Pack ...
//   PACKD_RETURN_IF_ERROR(staging.Download());
#ifndef PACKD_SERVER_DEVICE_STAGING_H_
#define PACKD_SERVER_DEVICE_STAGING_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/pack.h"

namespace packd {

// Not movable: the allocators Wrap returns refer to it.
class DeviceStaging {
 public:
  DeviceStaging(Backend* backend, Device device)
      : backend_(backend), device_(device) {}
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // If `view` is in host memory, copies it into a pooled device buffer and
  // points `view` at that copy. RESOURCE_EXHAUSTED when the device is full;
  // INTERNAL on a runtime failure.
  absl::Status Upload(TensorView* view);

  // An allocator for the device call: a result whose place `host` returns in
  // host memory
  // (`is_host(i)`) is first written to a device buffer, then copied there by
  // Download().
  OutputAllocator Wrap(OutputAllocator host,
                       std::function<bool(size_t)> is_host);

  // Copies every staged result to its host place.
  absl::Status Download();

 private:
  struct Pending {
    void* host;
    const void* device;
    int64_t bytes;
  };
  Backend* const backend_;
  const Device device_;
  std::vector<Buffer> buffers_;
  std::vector<Pending> pending_;
};

}  // namespace packd

#endif  // PACKD_SERVER_DEVICE_STAGING_H_
