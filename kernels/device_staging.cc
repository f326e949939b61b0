#include "kernels/device_staging.h"

#include <utility>

#include "base/status_macros.h"

namespace packd {

absl::Status DeviceStaging::Upload(TensorView* view) {
  if (!NeedsStaging(view->device)) return absl::OkStatus();
  const int64_t bytes = view->nbytes();
  const Device& device = stream_->device();
  PACKD_ASSIGN_OR_RETURN(Buffer buffer, runtime_->Allocate(bytes, device));
  PACKD_RETURN_IF_ERROR(
      runtime_->CopyToDevice(buffer.data(), view->data, bytes, *stream_));
  view->data = buffer.data();
  view->device = device;
  buffers_.push_back(std::move(buffer));
  return absl::OkStatus();
}

absl::StatusOr<void*> DeviceStaging::Result(void* place,
                                            const Device& place_device,
                                            int64_t bytes) {
  if (!NeedsStaging(place_device)) return place;
  PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                         runtime_->Allocate(bytes, stream_->device()));
  void* staged = buffer.data();
  pending_.push_back(Pending{place, staged, bytes});
  buffers_.push_back(std::move(buffer));
  return staged;
}

absl::Status DeviceStaging::Download() {
  for (const Pending& p : pending_) {
    PACKD_RETURN_IF_ERROR(
        runtime_->CopyToHost(p.host, p.device, p.bytes, *stream_));
  }
  pending_.clear();
  return absl::OkStatus();
}

}  // namespace packd
