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
#include "kernels/gpu/gpu_kernels.h"
#include "kernels/gpu/gpu_runtime.h"
#if !defined(PACKD_GPU_FAKE) && !defined(PACKD_GPU_HIP)
#include "base/cuda_address_range.h"
#endif
#include "base/status_macros.h"
#include "kernels/gpu/gpu_status.h"

namespace packd::PACKD_GPU_NS {
namespace {

// Devices whose context is lost (a sticky error), with the reason.
struct LostDevices {
  absl::Mutex mu;
  std::map<int, absl::Status> lost ABSL_GUARDED_BY(mu);
};
LostDevices& Lost() {
  static auto* lost = new LostDevices;
  return *lost;
}

absl::Status LostStatus(const Device& device) {
  LostDevices& l = Lost();
  absl::MutexLock lock(&l.mu);
  auto it = l.lost.find(device.index);
  if (it == l.lost.end()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "device ", device.ToString(), " is lost (", it->second.message(),
      "); every call on it fails until packd restarts"));
}

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
    // Device memory is counted: an acquisition, and a miss when the pool
    // allocates (below).
    if (!pinned_) GpuCounters().PoolAcquired();
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
            GpuCounters().PoolMissed();
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
      unsigned char uuid[16];
      if (gpuDeviceUuid(uuid, i) == gpuSuccess) {
        info.uuid = FormatDeviceUuid(uuid);
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
    return LostStatus(device);
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

  // Host memory moves through two pinned buffers of at most
  // kStagingChunkBytes, reused chunk after chunk: the next chunk is written
  // into one while the other is on its way.
  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Stream& stream) override {
    if (bytes == 0) return absl::OkStatus();
    const Device& device = stream.device();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    const int64_t chunk = std::min(bytes, kStagingChunkBytes);
    Buffer pinned[2];
    for (int64_t at = 0, i = 0; at < bytes; at += chunk, ++i) {
      Buffer& buffer = pinned[i % 2];
      if (buffer.data() == nullptr) {
        PACKD_ASSIGN_OR_RETURN(buffer, pinned_pool_.Acquire(chunk, device));
      } else {
        // The buffer's previous chunk must have left before it is refilled.
        PACKD_GPU_CHECK("host-to-device copy",
                        CountedSynchronize(NativeStream(stream)));
      }
      const int64_t n = std::min(chunk, bytes - at);
      std::memcpy(buffer.data(), static_cast<const char*>(src) + at, n);
      PACKD_GPU_CHECK(
          "host-to-device copy",
          CountedCopy(static_cast<char*>(dst) + at, buffer.data(), n,
                      gpuMemcpyHostToDevice, NativeStream(stream)));
    }
    PACKD_GPU_CHECK("host-to-device copy",
                    CountedSynchronize(NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Stream& stream) override {
    if (bytes == 0) return absl::OkStatus();
    const Device& device = stream.device();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    const int64_t chunk = std::min(bytes, kStagingChunkBytes);
    PACKD_ASSIGN_OR_RETURN(Buffer pinned, pinned_pool_.Acquire(chunk, device));
    for (int64_t at = 0; at < bytes; at += chunk) {
      const int64_t n = std::min(chunk, bytes - at);
      PACKD_GPU_CHECK(
          "device-to-host copy",
          CountedCopy(pinned.data(), static_cast<const char*>(src) + at, n,
                      gpuMemcpyDeviceToHost, NativeStream(stream)));
      PACKD_GPU_CHECK("device-to-host copy",
                      CountedSynchronize(NativeStream(stream)));
      std::memcpy(static_cast<char*>(dst) + at, pinned.data(), n);
    }
    return absl::OkStatus();
  }

  absl::Status CopyRows(void* dst, const void* src,
                        absl::Span<const int64_t> rows, int64_t row_bytes,
                        const Stream& stream) override {
    if (rows.empty() || row_bytes == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(stream.device().index));
    gpuError_t err = gpuSuccess;
    ForEachRowRun(rows, [&](int64_t to, int64_t from, int64_t count) {
      if (err != gpuSuccess) return;
      err = CountedCopy(static_cast<char*>(dst) + to * row_bytes,
                        static_cast<const char*>(src) + from * row_bytes,
                        count * row_bytes, gpuMemcpyDeviceToDevice,
                        NativeStream(stream));
    });
    PACKD_GPU_CHECK("row gather", err);
    return absl::OkStatus();
  }

  absl::StatusOr<Buffer> AllocateHost(int64_t bytes,
                                      const Device& device) override {
    return pinned_pool_.Acquire(static_cast<size_t>(bytes), device);
  }

  absl::Status CopyAsync(void* dst, const void* src, int64_t bytes,
                         CopyDirection direction,
                         const Stream& stream) override {
    if (bytes == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(stream.device().index));
    const bool up = direction == CopyDirection::kHostToDevice;
    PACKD_GPU_CHECK(
        up ? "host-to-device copy" : "device-to-host copy",
        CountedCopy(dst, src, bytes,
                    up ? gpuMemcpyHostToDevice : gpuMemcpyDeviceToHost,
                    NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::Status CopySpans(void* dst, const void* src, const CopySpan* spans,
                         int64_t count, const void* pattern,
                         int64_t pattern_bytes, const Stream& stream) override {
    static_assert(sizeof(CopySpan) == 3 * sizeof(int64_t),
                  "the kernel reads spans as three int64");
    PACKD_GPU_CHECK("set device", gpuSetDevice(stream.device().index));
    PACKD_GPU_CHECK(
        "span copy launch",
        LaunchCopySpans(static_cast<char*>(dst), static_cast<const char*>(src),
                        reinterpret_cast<const int64_t*>(spans), count,
                        static_cast<const char*>(pattern), pattern_bytes,
                        NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::Status Synchronize(const Stream& stream) override {
    PACKD_GPU_CHECK("set device", gpuSetDevice(stream.device().index));
    const gpuError_t err = CountedSynchronize(NativeStream(stream));
    // Done, or failed for good (the device's error is sticky): what the
    // stream's work held may go either way.
    stream.ReleaseHeld();
    PACKD_GPU_CHECK("stream synchronisation", err);
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
    const int index = device.index;
    DeviceMapping mapping;
    mapping.base = base;
    // Closed when the last holder lets go: the region's calls have all
    // finished (each synchronises before it returns).
    mapping.owner = std::shared_ptr<void>(base, [index](void* p) {
      (void)gpuSetDevice(index);
      (void)gpuIpcCloseMemHandle(p);
    });
    // The client's byte_size is checked against the allocation the handle
    // really exports, which the mapping starts at, and the memory must be on
    // the device named (device numbers depend on CUDA_VISIBLE_DEVICES).
    void* alloc_base = nullptr;
    size_t alloc_size = 0;
    if (gpuMemGetAddressRange(&alloc_base, &alloc_size, base) != gpuSuccess) {
      // The driver cannot say how far the mapping reaches: the size is not
      // checked, as a driver that answers does; the device still is.
      (void)gpuGetLastError();
      alloc_base = base;
      alloc_size = byte_size;
    }
    const uint64_t available =
        alloc_size - static_cast<uint64_t>(static_cast<char*>(base) -
                                           static_cast<char*>(alloc_base));
    if (byte_size > available) {
      return absl::InvalidArgumentError(absl::StrCat(
          "byte_size ", byte_size,
          " passes the end of the exported "
          "allocation, which has ",
          available,
          " bytes: an IPC handle maps "
          "the whole allocation from its start; register at most its size "
          "and address tensors by their offset in it (docs/gpu.md)"));
    }
    int actual = -1;
    PACKD_GPU_CHECK("device of the IPC mapping",
                    gpuPointerGetDevice(&actual, base));
    if (actual != device.index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the IPC handle's memory is on ", Device{kGpuKind, actual}.ToString(),
          " as this server numbers devices, not ", device.ToString(),
          " (check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES on both sides)"));
    }
    return mapping;
  }

 private:
  // Results and the scan's work arrays: up to 4 GiB cached per device.
  GpuPool device_pool_{/*pinned=*/false, size_t{4} << 30};
  // Bounce buffers for host transfers (two of at most kStagingChunkBytes per
  // transfer in flight): up to 1 GiB cached per device.
  GpuPool pinned_pool_{/*pinned=*/true, size_t{1} << 30};
  absl::Mutex mu_;
  std::map<int, std::vector<void*>> free_streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status RuntimeError(const char* what, gpuError_t err) {
  // Clear this thread's last error: the runtime would report it again from
  // the next check on this thread, whatever that call was.
  (void)gpuGetLastError();
  // A sticky error persists: the device answers nothing any more.
  int device = 0;
  (void)gpuGetDevice(&device);
  size_t free = 0, total = 0;
  const gpuError_t probe = gpuMemGetInfo(&free, &total);
  absl::Status status;
  if (err == gpuErrorMemoryAllocation) {
    status = absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of memory (", gpuGetErrorString(err), ")"));
  } else {
    status = absl::InternalError(absl::StrCat(PACKD_GPU_RUNTIME_NAME, " ", what,
                                              ": ", gpuGetErrorString(err)));
  }
  if (probe != gpuSuccess) {
    (void)gpuGetLastError();
    LostDevices& l = Lost();
    absl::MutexLock lock(&l.mu);
    l.lost.emplace(device, status);
  }
  return status;
}

#if !defined(PACKD_GPU_FAKE) && !defined(PACKD_GPU_HIP)
}  // namespace packd::PACKD_GPU_NS

gpuError_t gpuMemGetAddressRange(void** base, size_t* size, const void* p) {
  return packd::CudaMemGetAddressRange(base, size, p);
}

namespace packd::PACKD_GPU_NS {
#endif

std::unique_ptr<DeviceRuntime> MakeGpuRuntime() {
  return std::make_unique<GpuRuntime>();
}

}  // namespace packd::PACKD_GPU_NS
