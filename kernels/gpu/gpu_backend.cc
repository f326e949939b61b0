#include "kernels/gpu/gpu_backend.h"

#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/gpu/gpu_kernels.h"
#include "kernels/gpu/gpu_runtime.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"

namespace packd {
namespace {

#if defined(PACKD_GPU_HIP)
constexpr DeviceKind kKind = DeviceKind::kHip;
#else
constexpr DeviceKind kKind = DeviceKind::kCuda;
#endif

// The stream all work goes on: the device's default stream, which the caller's
// work on the same device orders with.
const gpuStream_t kStream = 0;

absl::Status RuntimeError(const char* what, gpuError_t err) {
  if (err == gpuErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": out of device memory (", gpuGetErrorString(err), ")"));
  }
  return absl::InternalError(absl::StrCat(PACKD_GPU_RUNTIME_NAME, " ", what,
                                          ": ", gpuGetErrorString(err)));
}

#define PACKD_GPU_CHECK(what, expr)                                      \
  do {                                                                   \
    const gpuError_t packd_err_ = (expr);                                \
    if (packd_err_ != gpuSuccess) return RuntimeError(what, packd_err_); \
  } while (false)

// Device (or pinned host) memory: one BlockPool per device, each caching at
// most `max_cached` bytes.
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

GpuPool& DevicePool() {
  static auto* pool = new GpuPool(/*pinned=*/false, size_t{4} << 30);
  return *pool;
}

GpuPool& PinnedPool() {
  static auto* pool = new GpuPool(/*pinned=*/true, size_t{1} << 30);
  return *pool;
}

class GpuPlan : public MaskPlan {
 public:
  gpu::MaskScan scan{};
  Buffer work;  // tile arrays, cu_seqlens, last_index and the row index, on the
                // device
};

class GpuBackend : public Backend {
 public:
  absl::string_view name() const override { return "gpu"; }

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

  absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(
      const TensorView& mask) override {
    auto plan = std::make_unique<GpuPlan>();
    const int64_t B = mask.shape[0], S = mask.shape[1];
    plan->batch = B;
    plan->seq = S;
    const int64_t tiles = B * gpu::TilesPerRow(S);
    // One device block: tile counts, offsets, lasts, cu_seqlens, last_index,
    // index.
    const int64_t words = tiles + (tiles + 1) + tiles + (B + 1) + B + B * S;
    PACKD_GPU_CHECK("set device", gpuSetDevice(mask.device.index));
    PACKD_ASSIGN_OR_RETURN(plan->work,
                           DevicePool().Acquire(words * 8, mask.device));
    auto* w = static_cast<int64_t*>(plan->work.data());
    gpu::MaskScan& scan = plan->scan;
    scan.mask = mask.data;
    scan.batch = B;
    scan.seq = S;
    scan.width = static_cast<int>(ItemSize(mask.dtype));
    scan.is_float = IsFloatingPoint(mask.dtype);
    scan.tile_counts = w;
    scan.tile_offsets = scan.tile_counts + tiles;
    scan.tile_last = scan.tile_offsets + tiles + 1;
    scan.cu_seqlens = scan.tile_last + tiles;
    scan.last_index = scan.cu_seqlens + B + 1;
    scan.index = scan.last_index + B;
    PACKD_GPU_CHECK("mask scan launch", gpu::LaunchMaskScan(scan, kStream));
    // The one synchronisation of a call: cu_seqlens and last_index to the host.
    const int64_t meta = 2 * B + 1;
    PACKD_ASSIGN_OR_RETURN(Buffer pinned,
                           PinnedPool().Acquire(meta * 8, mask.device));
    PACKD_GPU_CHECK("copy of cu_seqlens",
                    gpuMemcpyAsync(pinned.data(), scan.cu_seqlens, meta * 8,
                                   gpuMemcpyDeviceToHost, kStream));
    PACKD_GPU_CHECK("mask scan", gpuStreamSynchronize(kStream));
    const auto* host = static_cast<const int64_t*>(pinned.data());
    plan->cu_seqlens.assign(host, host + B + 1);
    plan->last_index.assign(host + B + 1, host + meta);
    return plan;
  }

  absl::Status Gather(const MaskPlan& base, const TensorView& x,
                      const TensorView& out) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t total = plan.total_active();
    if (total == 0 || out.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(x.device.index));
    if (plan.all_active()) {
      PACKD_GPU_CHECK("copy", gpuMemcpyAsync(out.data, x.data, out.nbytes(),
                                             gpuMemcpyDeviceToDevice, kStream));
      return absl::OkStatus();
    }
    PACKD_GPU_CHECK("gather launch",
                    gpu::LaunchGather(x.data, out.data, plan.scan.index, total,
                                      out.nbytes() / total, kStream));
    return absl::OkStatus();
  }

  absl::Status Scatter(const MaskPlan& base, const TensorView& packed,
                       const TensorView& dense) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t positions = plan.batch * plan.seq;
    if (positions == 0 || dense.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(dense.device.index));
    const int64_t row_bytes = dense.nbytes() / positions;
    if (plan.total_active() == 0) {
      PACKD_GPU_CHECK("zero fill",
                      gpuMemsetAsync(dense.data, 0, dense.nbytes(), kStream));
      return absl::OkStatus();
    }
    if (plan.all_active()) {
      PACKD_GPU_CHECK("copy",
                      gpuMemcpyAsync(dense.data, packed.data, dense.nbytes(),
                                     gpuMemcpyDeviceToDevice, kStream));
      return absl::OkStatus();
    }
    PACKD_GPU_CHECK(
        "zero-fill launch",
        gpu::LaunchZeroInactive(plan.scan, dense.data, row_bytes, kStream));
    PACKD_GPU_CHECK(
        "scatter launch",
        gpu::LaunchScatterRows(packed.data, dense.data, plan.scan.index,
                               plan.total_active(), row_bytes, kStream));
    return absl::OkStatus();
  }

  absl::StatusOr<Buffer> Allocate(int64_t bytes,
                                  const Device& device) override {
    return DevicePool().Acquire(static_cast<size_t>(bytes), device);
  }

  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Device& device) override {
    if (bytes == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    PACKD_ASSIGN_OR_RETURN(Buffer pinned, PinnedPool().Acquire(bytes, device));
    std::memcpy(pinned.data(), src, bytes);
    PACKD_GPU_CHECK("host-to-device copy",
                    gpuMemcpyAsync(dst, pinned.data(), bytes,
                                   gpuMemcpyHostToDevice, kStream));
    PACKD_GPU_CHECK("host-to-device copy", gpuStreamSynchronize(kStream));
    return absl::OkStatus();
  }

  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Device& device) override {
    if (bytes == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(device.index));
    PACKD_ASSIGN_OR_RETURN(Buffer pinned, PinnedPool().Acquire(bytes, device));
    PACKD_GPU_CHECK("device-to-host copy",
                    gpuMemcpyAsync(pinned.data(), src, bytes,
                                   gpuMemcpyDeviceToHost, kStream));
    PACKD_GPU_CHECK("device-to-host copy", gpuStreamSynchronize(kStream));
    std::memcpy(dst, pinned.data(), bytes);
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
};

}  // namespace

void RegisterGpuBackends(Registry& registry) {
  registry.Add(kKind, std::make_unique<GpuBackend>()).IgnoreError();
}

}  // namespace packd
