#include "kernels/device_runtime.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace packd {

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (release_) release_(handle_);
    device_ = other.device_;
    handle_ = other.handle_;
    release_ = std::move(other.release_);
    other.handle_ = nullptr;
    other.release_ = nullptr;
  }
  return *this;
}

Stream::~Stream() {
  if (release_) release_(handle_);
}

absl::StatusOr<Stream> DeviceRuntime::AcquireStream(const Device& device) {
  return Stream(device, nullptr, nullptr);
}

absl::Status DeviceRuntime::Synchronize(const Stream&) {
  return absl::OkStatus();
}

void ForEachRowRun(
    absl::Span<const int64_t> rows,
    const std::function<void(int64_t to, int64_t from, int64_t count)>& copy) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < n;) {
    int64_t end = j + 1;
    while (end < n && rows[end] == rows[end - 1] + 1) ++end;
    copy(j, rows[j], end - j);
    j = end;
  }
}

absl::StatusOr<DeviceMapping> DeviceRuntime::OpenIpcMemory(absl::string_view,
                                                           const Device& device,
                                                           uint64_t) {
  return absl::FailedPreconditionError(absl::StrCat(
      "IPC memory handles are for GPU devices, not ", device.ToString()));
}

namespace {

class HostRuntime : public DeviceRuntime {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }

  std::vector<DeviceInfo> ListDevices() const override {
    DeviceInfo cpu;
    cpu.memory_bytes = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                       static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    return {cpu};
  }

  absl::Status CheckDevice(const Device& device) const override {
    if (device == Device::Cpu()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.ToString(), " is not available: host memory is cpu"));
  }

  absl::StatusOr<Buffer> Allocate(int64_t bytes, const Device&) override {
    return HostBufferPool::Global().Acquire(static_cast<size_t>(bytes));
  }

  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Stream&) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Stream&) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyRows(void* dst, const void* src,
                        absl::Span<const int64_t> rows, int64_t row_bytes,
                        const Stream&) override {
    if (row_bytes == 0) return absl::OkStatus();
    ForEachRowRun(rows, [&](int64_t to, int64_t from, int64_t count) {
      std::memcpy(static_cast<char*>(dst) + to * row_bytes,
                  static_cast<const char*>(src) + from * row_bytes,
                  count * row_bytes);
    });
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<DeviceRuntime> MakeHostRuntime() {
  return std::make_unique<HostRuntime>();
}

}  // namespace packd
