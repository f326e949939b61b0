#include "kernels/gpu/gpu_device_runtime.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/gpu/gpu_runtime.h"
#include "kernels/gpu/gpu_status.h"
#include "kernels/status_macros.h"

namespace packd {
namespace {

class GpuPool {
 public:
  GpuPool(bool pinned, size_t max_cached)
      : pinned_(pinned), max_cached_(max_cached) {}

  absl::StatusOr<Buffer> Acquire(size_t bytes, const Device& device) {
    BlockPool* pool = nullptr;
    {
      absl::MutexLock lock(&mu_);
      std::unique_ptr<BlockPool>& slot = pools_[device.index];
      if (slot == nullptr) slot = MakePool(device);
      pool = slot.get();
    }
    return pool->Acquire(bytes);
  }

 private:
  std::unique_ptr<BlockPool> MakePool(const Device& device) const {
    const int index = device.index;
    const bool pinned = pinned_;
    return std::make_unique<BlockPool>(
        pinned ? Device::Cpu() : device, max_cached_,
        [](size_t bytes) {
          return std::max<size_t>(256, (bytes + 255) / 256 * 256);
        },
        [index, pinned](size_t capacity) -> absl::StatusOr<void*> {
          void* data = nullptr;
          PACKD_GPU_CHECK("set device", gpuSetDevice(index));
          if (pinned) {
            PACKD_GPU_CHECK("pinned host allocation",
                            gpuMallocHost(&data, capacity));
          } else {
            PACKD_GPU_CHECK("device allocation", gpuMalloc(&data, capacity));
          }
          return data;
        },
        [index, pinned](void* data, size_t) {
          (void)gpuSetDevice(index);  // a free has no caller to report to
          if (pinned) {
            (void)gpuFreeHost(data);
          } else {
            (void)gpuFree(data);
          }
        });
  }

  const bool pinned_;
  const size_t max_cached_;
  absl::Mutex mu_;
  std::map<int, std::unique_ptr<BlockPool>> pools_ ABSL_GUARDED_BY(mu_);
};

class GpuRuntime : public DeviceRuntime {
 public:
  DeviceKind kind() const override { return kGpuKind; }

  std::vector<DeviceInfo> ListDevices() const override {
    std::vector<DeviceInfo> devices;
    int count = 0;
    if (gpuGetDeviceCount(&count) != gpuSuccess) {
      (void)gpuGetLastError();  // no driver: no devices
      return devices;
    }
    for (int i = 0; i < count; ++i) {
      DeviceInfo info;
      info.device = Device{kGpuKind, i};
      gpuDeviceProp_t prop;
      if (gpuGetDeviceProperties(&prop, i) == gpuSuccess) {
        info.memory_bytes = prop.totalGlobalMem;
      } else {
        (void)gpuGetLastError();
      }
      devices.push_back(info);
    }
    return devices;
  }

  absl::Status CheckDevice(const Device& device) const override {
    int count = 0;
    const gpuError_t err = gpuGetDeviceCount(&count);
    if (err != gpuSuccess) {
      (void)gpuGetLastError();  // clear the sticky error
      return absl::FailedPreconditionError(absl::StrCat(
          "device ", device.ToString(), " is not available: ",
          PACKD_GPU_RUNTIME_NAME, " reports ", gpuGetErrorString(err)));
    }
    if (device.index >= count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device ", device.ToString(), " is not available: this machine has ",
          count, " ", PACKD_GPU_RUNTIME_NAME, " device(s)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Stream> AcquireStream(const Device& device) override {
    void* handle = nullptr;
    {
      absl::MutexLock lock(&mu_);
      std::vector<void*>& free = free_streams_[device.index];
      if (!free.empty()) {
        handle = free.back();
        free.pop_back();
      }
    }
    if (handle == nullptr) {
      PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
      gpuStream_t created = nullptr;
      PACKD_GPU_CHECK("stream creation",
                      gpuStreamCreateWithFlags(&created, gpuStreamNonBlocking));
      handle = created;
    }
    const int index = device.index;
    return Stream(device, handle, [this, index](void* h) {
      absl::MutexLock lock(&mu_);
      free_streams_[index].push_back(h);
    });
  }

  absl::StatusOr<Buffer> Allocate(int64_t bytes,
                                  const Device& device) override {
    return device_pool_.Acquire(static_cast<size_t>(bytes), device);
  }

  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Stream& stream) override {
    if (bytes == 0) return absl::OkStatus();
    const Device& device = stream.device();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    PACKD_ASSIGN_OR_RETURN(Buffer pinned, pinned_pool_.Acquire(bytes, device));
    std::memcpy(pinned.data(), src, bytes);
    PACKD_GPU_CHECK(
        "host-to-device copy",
        gpuMemcpyAsync(dst, pinned.data(), bytes, gpuMemcpyHostToDevice,
                       NativeStream(stream)));
    PACKD_GPU_CHECK("host-to-device copy",
                    gpuStreamSynchronize(NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Stream& stream) override {
    if (bytes == 0) return absl::OkStatus();
    const Device& device = stream.device();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    PACKD_ASSIGN_OR_RETURN(Buffer pinned, pinned_pool_.Acquire(bytes, device));
    PACKD_GPU_CHECK(
        "device-to-host copy",
        gpuMemcpyAsync(pinned.data(), src, bytes, gpuMemcpyDeviceToHost,
                       NativeStream(stream)));
    PACKD_GPU_CHECK("device-to-host copy",
                    gpuStreamSynchronize(NativeStream(stream)));
    std::memcpy(dst, pinned.data(), bytes);
    return absl::OkStatus();
  }

  absl::Status Synchronize(const Stream& stream) override {
    PACKD_GPU_CHECK("set device", gpuSetDevice(stream.device().index));
    PACKD_GPU_CHECK("stream synchronisation",
                    gpuStreamSynchronize(NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceMapping> OpenIpcMemory(absl::string_view handle,
                                              const Device& device,
                                              uint64_t byte_size) override {
    gpuIpcMemHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "IPC handles are 64 bytes");
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    void* base = nullptr;
    PACKD_GPU_CHECK("IPC open", gpuIpcOpenMemHandle(
                                    &base, ipc, gpuIpcMemLazyEnablePeerAccess));
    (void)byte_size;  // the runtime does not report the exported size; slices
                      // are checked against the size the client registered
    DeviceMapping mapping;
    mapping.base = base;
    const int index = device.index;
    mapping.owner = std::shared_ptr<void>(base, [index](void* p) {
      (void)gpuSetDevice(index);
      (void)gpuIpcCloseMemHandle(p);
    });
    return mapping;
  }

 private:
  // Results and the scan's work arrays: up to 4 GiB cached per device.
  GpuPool device_pool_{/*pinned=*/false, size_t{4} << 30};
  // Bounce buffers for host transfers: up to 1 GiB cached per device.
  GpuPool pinned_pool_{/*pinned=*/true, size_t{1} << 30};
  absl::Mutex mu_;
  std::map<int, std::vector<void*>> free_streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<DeviceRuntime> MakeGpuRuntime() {
  return std::make_unique<GpuRuntime>();
}

}  // namespace packd
