#include "server/device_staging.h"

#include <utility>

#include "kernels/status_macros.h"

namespace packd {

absl::Status DeviceStaging::Upload(TensorView* view) {
  if (view->device.kind != DeviceKind::kCpu) return absl::OkStatus();
  const int64_t bytes = view->nbytes();
  PACKD_ASSIGN_OR_RETURN(Buffer buffer, backend_->Allocate(bytes, device_));
  PACKD_RETURN_IF_ERROR(
      backend_->CopyToDevice(buffer.data(), view->data, bytes, device_));
  view->data = buffer.data();
  view->device = device_;
  buffers_.push_back(std::move(buffer));
  return absl::OkStatus();
}

OutputAllocator DeviceStaging::Wrap(OutputAllocator host,
                                    std::function<bool(size_t)> is_host) {
  return [this, host = std::move(host), is_host = std::move(is_host)](
             size_t index, int64_t bytes) -> absl::StatusOr<void*> {
    PACKD_ASSIGN_OR_RETURN(void* target, host(index, bytes));
    if (!is_host(index)) return target;
    PACKD_ASSIGN_OR_RETURN(Buffer buffer, backend_->Allocate(bytes, device_));
    void* staged = buffer.data();
    pending_.push_back(Pending{target, staged, bytes});
    buffers_.push_back(std::move(buffer));
    return staged;
  };
}

absl::Status DeviceStaging::Download() {
  for (const Pending& p : pending_) {
    PACKD_RETURN_IF_ERROR(
        backend_->CopyToHost(p.host, p.device, p.bytes, device_));
  }
  pending_.clear();
  return absl::OkStatus();
}

}  // namespace packd
