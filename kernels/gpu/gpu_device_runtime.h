// The DeviceRuntime of cuda:N (or hip:N in a ROCm build): device memory from a
// per-device pool, host transfers staged through pinned buffers, a pool of
// streams (one per call in flight), and IPC memory for device regions.
//
//   registry.SetRuntime(MakeGpuRuntime());  // done by RegisterGpuBackends
#ifndef PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_
#define PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_

#include <memory>

#include "kernels/device_runtime.h"
#include "kernels/gpu/gpu_runtime.h"

namespace packd {

// The device kind this build's GPU sources serve.
#if defined(PACKD_GPU_HIP)
inline constexpr DeviceKind kGpuKind = DeviceKind::kHip;
#else
inline constexpr DeviceKind kGpuKind = DeviceKind::kCuda;
#endif

std::unique_ptr<DeviceRuntime> MakeGpuRuntime();

// The runtime's stream behind a Stream that MakeGpuRuntime() gave out.
inline gpuStream_t NativeStream(const Stream& stream) {
  return static_cast<gpuStream_t>(stream.handle());
}

}  // namespace packd

#endif  // PACKD_KERNELS_GPU_GPU_DEVICE_RUNTIME_H_
