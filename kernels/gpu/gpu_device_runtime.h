// The DeviceRuntime of cuda:N (or hip:N in a ROCm build): device memory from a
// per-device pool, host transfers staged in bounded chunks through reused
// pinned buffers, a pool of streams (one per call in flight), IPC memory for
// device regions checked against the exported allocation, and lost devices
// (a sticky runtime error) reported as UNAVAILABLE.
//
//   registry.SetRuntime(MakeGpuRuntime());  // done by RegisterGpuBackends
#ifndef PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_
#define PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_

#include <cstdint>
#include <memory>

#include "kernels/device_runtime.h"
#include "kernels/gpu/gpu_runtime.h"

namespace packd::PACKD_GPU_NS {

// The device kind this build's GPU sources serve.
#if defined(PACKD_GPU_HIP)
inline constexpr DeviceKind kGpuKind = DeviceKind::kHip;
#else
inline constexpr DeviceKind kGpuKind = DeviceKind::kCuda;
#endif

// Host transfers move through pinned buffers of at most this many bytes, two
// per transfer, whatever the tensor's size.
inline constexpr int64_t kStagingChunkBytes = int64_t{8} << 20;

std::unique_ptr<DeviceRuntime> MakeGpuRuntime();

// The runtime's stream behind a Stream that MakeGpuRuntime() gave out.
inline gpuStream_t NativeStream(const Stream& stream) {
  return static_cast<gpuStream_t>(stream.handle());
}

}  // namespace packd::PACKD_GPU_NS

#endif  // PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_
