#include "kernels/device_staging.h"

#include <cstring>
#include <utility>

#include "base/status_macros.h"

namespace packd {

absl::Status DeviceStaging::Upload(TensorView* view) {
  if (!NeedsStaging(view->device)) return absl::OkStatus();
  const int64_t bytes = view->nbytes();
  const Device& device = stream_->device();
  PACKD_ASSIGN_OR_RETURN(Buffer buffer, runtime_->Allocate(bytes, device));
  if (bytes <= kQueuedBytes) {
    PACKD_ASSIGN_OR_RETURN(Buffer pinned,
                           runtime_->AllocateHost(bytes, device));
    if (bytes > 0) std::memcpy(pinned.data(), view->data, bytes);
    PACKD_RETURN_IF_ERROR(
        runtime_->CopyAsync(buffer.data(), pinned.data(), bytes,
                            CopyDirection::kHostToDevice, *stream_));
    buffers_.push_back(std::move(pinned));
  } else {
    PACKD_RETURN_IF_ERROR(
        runtime_->CopyToDevice(buffer.data(), view->data, bytes, *stream_));
  }
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
    if (p.bytes > kQueuedBytes) {
      PACKD_RETURN_IF_ERROR(
          runtime_->CopyToHost(p.host, p.device, p.bytes, *stream_));
      continue;
    }
    PACKD_ASSIGN_OR_RETURN(Buffer pinned,
                           runtime_->AllocateHost(p.bytes, stream_->device()));
    PACKD_RETURN_IF_ERROR(runtime_->CopyAsync(pinned.data(), p.device, p.bytes,
                                              CopyDirection::kDeviceToHost,
                                              *stream_));
    queued_.push_back(Pending{p.host, pinned.data(), p.bytes});
    buffers_.push_back(std::move(pinned));
  }
  pending_.clear();
  return absl::OkStatus();
}

void DeviceStaging::Deliver() {
  for (const Pending& p : queued_) {
    if (p.bytes > 0) std::memcpy(p.host, p.device, p.bytes);
  }
  queued_.clear();
}

}  // namespace packd
