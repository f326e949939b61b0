// MakeCudaDeviceMemory for a client built with CUDA: libtorch's CUDA tensors,
// their allocations found with the driver's cuMemGetAddressRange
// (CudaMemGetAddressRange) and exported with cudaIpcGetMemHandle.
#include <cuda_runtime_api.h>

#if defined(PACKD_CLIENT_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>
// libtorch 2.1 and later say when the caching allocator frees a segment.
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define PACKD_CLIENT_WATCHES_SEGMENTS 1
#endif
#endif

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/cuda_address_range.h"
#include "base/tensor_view.h"
#include "client/device_memory.h"
#include "client/stream_order.h"

namespace packd {
namespace {

absl::Status CudaError(const char* what, cudaError_t err) {
  (void)cudaGetLastError();
  return absl::InternalError(
      absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(err)));
}

#define PACKD_CUDA_CHECK(what, call)                                 \
  do {                                                               \
    const cudaError_t packd_err = (call);                            \
    if (packd_err != cudaSuccess) return CudaError(what, packd_err); \
  } while (0)

// Makes a device current for the calls of one scope, and the caller's own
// current device current again when it ends: the client never moves the
// device a caller's thread works on. cudaSetDevice runs even when the index
// is already current: on a thread that has made no CUDA call yet it is what
// makes the device's primary context current, which the driver calls that
// follow (cuMemGetAddressRange) need.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != current_) (void)cudaSetDevice(previous_);
  }
  absl::Status Set(int index) {
    PACKD_CUDA_CHECK("current device", cudaGetDevice(&previous_));
    PACKD_CUDA_CHECK("set device", cudaSetDevice(index));
    current_ = index;
    return absl::OkStatus();
  }

 private:
  int previous_ = -1;
  int current_ = -1;
};

// The CUDA runtime's calls WaitForCallersWork makes, on the current device.
struct CudaRuntime {
  using Event = cudaEvent_t;
  absl::Status SynchronizeDevice() {
    PACKD_CUDA_CHECK("device synchronisation", cudaDeviceSynchronize());
    return absl::OkStatus();
  }
  absl::StatusOr<Event> RecordEvent(void* stream) {
    cudaEvent_t event = nullptr;
    PACKD_CUDA_CHECK("event",
                     cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t err =
        cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(event);
      return CudaError("event record", err);
    }
    return event;
  }
  absl::Status SynchronizeEvent(Event event) {
    PACKD_CUDA_CHECK("event synchronisation", cudaEventSynchronize(event));
    return absl::OkStatus();
  }
  void DestroyEvent(Event event) { (void)cudaEventDestroy(event); }
};

// The caller's current stream on GPU `index`: libtorch's, where its CUDA
// runtime is linked in (null when it is the default stream, CUDA's legacy
// one); else nullopt (the device is waited for).
std::optional<void*> CallersStream(int index) {
#if defined(PACKD_CLIENT_TORCH_CUDA)
  cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index))
          .stream();
  return static_cast<void*>(stream);
#else
  (void)index;
  return std::nullopt;
#endif
}

#if defined(PACKD_CLIENT_WATCHES_SEGMENTS)
// The segments a client watches, by base address, and what to call when the
// caching allocator frees one (empty_cache, its out-of-memory retry): the
// client then unregisters its region, so that packd lets the memory go
// (docs/gpu.md). Process-wide, as the allocator's trace trackers are; the
// callbacks only queue work for the client's next call.
class SegmentWatch {
 public:
  static SegmentWatch& Global() {
    static auto* watch = new SegmentWatch;
    return *watch;
  }
  void Add(uintptr_t base, std::function<void()> freed) {
    std::call_once(attached_, [] {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
          [](const c10::cuda::CUDACachingAllocator::TraceEntry& entry) {
            using Action = c10::cuda::CUDACachingAllocator::TraceEntry::Action;
            // Called with the allocator's lock held: SegmentWatch's lock
            // and the callbacks' never call into the allocator.
            if (entry.action_ == Action::SEGMENT_FREE) {
              Global().Freed(static_cast<uintptr_t>(entry.addr_));
            }
          });
    });
    absl::MutexLock lock(&mu_);
    by_base_[base].push_back(std::move(freed));
  }

 private:
  void Freed(uintptr_t base) {
    std::vector<std::function<void()>> freed;
    {
      absl::MutexLock lock(&mu_);
      auto it = by_base_.find(base);
      if (it == by_base_.end()) return;
      freed = std::move(it->second);
      by_base_.erase(it);
    }
    for (auto& f : freed) f();
  }

  std::once_flag attached_;
  absl::Mutex mu_;
  std::map<uintptr_t, std::vector<std::function<void()>>> by_base_
      ABSL_GUARDED_BY(mu_);
};
#endif

// Runs the torch calls that may throw (allocation, copies) as a Status.
template <typename F>
absl::StatusOr<at::Tensor> Torch(const char* what, F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
}

class CudaMemory : public DeviceMemory {
 public:
  std::optional<int> DeviceOf(const at::Tensor& t) const override {
    if (!t.is_cuda()) return std::nullopt;
    return t.device().index();
  }

  std::string Name(int index) const override {
    return absl::StrCat("cuda:", index);
  }

  absl::StatusOr<std::string> Uuid(int index) const override {
    cudaDeviceProp prop;
    PACKD_CUDA_CHECK("device properties",
                     cudaGetDeviceProperties(&prop, index));
    unsigned char bytes[16];
    for (int i = 0; i < 16; ++i) {
      bytes[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
    }
    return FormatDeviceUuid(bytes);
  }

  absl::StatusOr<Allocation> AllocationOf(const at::Tensor& t) const override {
    DeviceScope scope;
    if (absl::Status set = scope.Set(t.device().index()); !set.ok()) return set;
    void* base = nullptr;
    size_t size = 0;
    int driver_result = 0;
    if (CudaMemGetAddressRange(&base, &size, t.data_ptr(), &driver_result) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InternalError(absl::StrCat(
          "CUDA address range of the tensor's allocation: the driver answered "
          "CUresult ",
          driver_result, " (cuMemGetAddressRange, cuPointerGetAttribute)"));
    }
    cudaIpcMemHandle_t handle;
    PACKD_CUDA_CHECK(
        "IPC handle (memory from cudaMallocAsync or expandable segments "
        "cannot be exported; use libtorch's default caching allocator)",
        cudaIpcGetMemHandle(&handle, base));
    Allocation out;
    out.base = reinterpret_cast<uintptr_t>(base);
    out.size = size;
    out.ipc_handle.assign(reinterpret_cast<const char*>(&handle),
                          sizeof(handle));
    return out;
  }

  absl::StatusOr<at::Tensor> Empty(at::IntArrayRef shape, at::ScalarType dtype,
                                   int index) const override {
    return Torch("CUDA allocation", [&] {
      return at::empty(
          shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, index));
    });
  }

  absl::StatusOr<at::Tensor> ToDevice(const at::Tensor& host,
                                      int index) const override {
    return Torch("copy to the GPU", [&] {
      return host.to(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
    });
  }

  absl::Status Synchronize(int index) const override {
    // The caller's current stream (libtorch with CUDA; the legacy default
    // stream is one), else every stream of the device: a CPU-only libtorch
    // cannot name its stream.
    DeviceScope scope;
    if (absl::Status set = scope.Set(index); !set.ok()) return set;
    CudaRuntime runtime;
    return WaitForCallersWork(runtime, CallersStream(index));
  }

#if defined(PACKD_CLIENT_WATCHES_SEGMENTS)
  void Watch(uintptr_t base, std::function<void()> freed) const override {
    SegmentWatch::Global().Add(base, std::move(freed));
  }
#endif
};

}  // namespace

std::shared_ptr<DeviceMemory> MakeCudaDeviceMemory() {
  return std::make_shared<CudaMemory>();
}

}  // namespace packd
