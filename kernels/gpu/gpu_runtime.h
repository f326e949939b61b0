// The one place CUDA and HIP differ: gpu* names for the runtime API, so that
// the GPU sources (gpu_kernels.cu, gpu_backend.cc, gpu_device_runtime.cc) build
// for CUDA (nvcc, default) and for ROCm (hipcc, PACKD_GPU_HIP defined).
//
// clang-format off
//   gpuError_t err = gpuMemcpyAsync(dst, src, n, gpuMemcpyDeviceToDevice, stream);
//   if (err != gpuSuccess) return gpuGetErrorString(err);
// clang-format on
#ifndef PACKD_KERNELS_GPU_GPU_RUNTIME_H_
#define PACKD_KERNELS_GPU_GPU_RUNTIME_H_

#if defined(PACKD_GPU_FAKE)

// A stand-in runtime in host memory with CUDA's semantics, for tests of the
// GPU path without a GPU: the build that defines PACKD_GPU_FAKE names its
// header in PACKD_GPU_FAKE_RUNTIME_H (tests/fake_gpu/CMakeLists.txt).
#include PACKD_GPU_FAKE_RUNTIME_H

#define PACKD_GPU_NS fake_gpu
#define PACKD_GPU_RUNTIME_NAME "fake GPU"
using gpuError_t = fakegpu::Error;
using gpuStream_t = fakegpu::Stream;
using gpuIpcMemHandle_t = fakegpu::IpcMemHandle;
using gpuDeviceProp_t = fakegpu::DeviceProp;
constexpr gpuError_t gpuSuccess = fakegpu::kSuccess;
constexpr gpuError_t gpuErrorMemoryAllocation = fakegpu::kErrorMemoryAllocation;
#define gpuGetErrorString fakegpu::GetErrorString
#define gpuGetLastError fakegpu::GetLastError
#define gpuGetDeviceCount fakegpu::GetDeviceCount
#define gpuSetDevice fakegpu::SetDevice
#define gpuGetDevice fakegpu::GetDevice
#define gpuMalloc fakegpu::Malloc
#define gpuFree fakegpu::Free
#define gpuMallocHost fakegpu::MallocHost
#define gpuFreeHost fakegpu::FreeHost
#define gpuMemcpyAsync fakegpu::MemcpyAsync
#define gpuMemsetAsync fakegpu::MemsetAsync
#define gpuMemGetInfo fakegpu::MemGetInfo
#define gpuStreamSynchronize fakegpu::StreamSynchronize
#define gpuStreamCreateWithFlags fakegpu::StreamCreateWithFlags
#define gpuStreamNonBlocking fakegpu::kStreamNonBlocking
#define gpuGetDeviceProperties fakegpu::GetDeviceProperties
#define gpuIpcOpenMemHandle fakegpu::IpcOpenMemHandle
#define gpuIpcCloseMemHandle fakegpu::IpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess fakegpu::kIpcMemLazyEnablePeerAccess
#define gpuMemcpyHostToDevice fakegpu::kHostToDevice
#define gpuMemcpyDeviceToHost fakegpu::kDeviceToHost
#define gpuMemcpyDeviceToDevice fakegpu::kDeviceToDevice

inline gpuError_t gpuMemGetAddressRange(void** base, size_t* size,
                                        const void* p) {
  return fakegpu::MemGetAddressRange(base, size, p);
}
inline gpuError_t gpuPointerGetDevice(int* device, const void* p) {
  return fakegpu::PointerGetDevice(device, p);
}
inline gpuError_t gpuDeviceUuid(unsigned char out[16], int device) {
  fakegpu::DeviceProp prop;
  const gpuError_t err = fakegpu::GetDeviceProperties(&prop, device);
  for (int i = 0; i < 16; ++i) out[i] = prop.uuid.bytes[i];
  return err;
}

#elif defined(PACKD_GPU_HIP)

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#else
#include <hip/hip_runtime_api.h>
#endif

#define PACKD_GPU_NS gpu
#define PACKD_GPU_RUNTIME_NAME "HIP"
using gpuError_t = hipError_t;
using gpuStream_t = hipStream_t;
using gpuIpcMemHandle_t = hipIpcMemHandle_t;
using gpuEvent_t = hipEvent_t;
#define gpuEventCreate hipEventCreate
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
constexpr gpuError_t gpuSuccess = hipSuccess;
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuSetDevice hipSetDevice
#define gpuGetDevice hipGetDevice
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMallocHost hipHostMalloc
#define gpuFreeHost hipHostFree
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemGetInfo hipMemGetInfo
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
using gpuDeviceProp_t = hipDeviceProp_t;
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuIpcOpenMemHandle hipIpcOpenMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuErrorMemoryAllocation hipErrorOutOfMemory

inline gpuError_t gpuMemGetAddressRange(void** base, size_t* size,
                                        const void* p) {
  hipDeviceptr_t b = nullptr;
  const hipError_t err = hipMemGetAddressRange(&b, size, const_cast<void*>(p));
  *base = b;
  return err;
}
inline gpuError_t gpuPointerGetDevice(int* device, const void* p) {
  hipPointerAttribute_t attributes;
  const hipError_t err = hipPointerGetAttributes(&attributes, p);
  *device = attributes.device;
  return err;
}
inline gpuError_t gpuDeviceUuid(unsigned char out[16], int device) {
  hipUUID uuid;
  const hipError_t err = hipDeviceGetUuid(&uuid, device);
  for (int i = 0; i < 16; ++i)
    out[i] = static_cast<unsigned char>(uuid.bytes[i]);
  return err;
}

#else  // CUDA

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#include <cuda_runtime_api.h>
#endif

#define PACKD_GPU_NS gpu
#define PACKD_GPU_RUNTIME_NAME "CUDA"
using gpuError_t = cudaError_t;
using gpuStream_t = cudaStream_t;
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
using gpuEvent_t = cudaEvent_t;
#define gpuEventCreate cudaEventCreate
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
constexpr gpuError_t gpuSuccess = cudaSuccess;
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuSetDevice cudaSetDevice
#define gpuGetDevice cudaGetDevice
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMallocHost cudaMallocHost
#define gpuFreeHost cudaFreeHost
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemGetInfo cudaMemGetInfo
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
using gpuDeviceProp_t = cudaDeviceProp;
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuErrorMemoryAllocation cudaErrorMemoryAllocation

// The driver's cuMemGetAddressRange, reached through the runtime so that packd
// does not link the driver library (absent where there is no GPU).
gpuError_t gpuMemGetAddressRange(void** base, size_t* size, const void* p);
inline gpuError_t gpuPointerGetDevice(int* device, const void* p) {
  cudaPointerAttributes attributes;
  const cudaError_t err = cudaPointerGetAttributes(&attributes, p);
  *device = attributes.device;
  return err;
}
inline gpuError_t gpuDeviceUuid(unsigned char out[16], int device) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  for (int i = 0; i < 16; ++i)
    out[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
  return err;
}

#endif

// Functions shared by host and device code.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define PACKD_HOST_DEVICE __host__ __device__
#else
#define PACKD_HOST_DEVICE
#endif

// The stream operations and synchronisations of the GPU sources, counted
// (kernels/device_counters.h): the GPU sources call these, never the gpu*
// functions they wrap, and each launcher counts the kernels it queues.
#include "kernels/device_counters.h"

namespace packd::PACKD_GPU_NS {

using gpuMemcpyKind_t = decltype(gpuMemcpyHostToDevice);

// The counters of this build's device kind (cuda, or hip in a ROCm build).
inline DeviceCounters& GpuCounters() {
#if defined(PACKD_GPU_HIP)
  return DeviceCounters::Of(static_cast<DeviceKind>(2));
#else
  return DeviceCounters::Of(static_cast<DeviceKind>(1));
#endif
}

inline gpuError_t CountedCopy(void* dst, const void* src, size_t bytes,
                              gpuMemcpyKind_t kind, gpuStream_t stream) {
  GpuCounters().Operation(
      kind == gpuMemcpyHostToDevice   ? DeviceOp::kCopyHostToDevice
      : kind == gpuMemcpyDeviceToHost ? DeviceOp::kCopyDeviceToHost
                                      : DeviceOp::kCopyDeviceToDevice,
      static_cast<int64_t>(bytes));
  return gpuMemcpyAsync(dst, src, bytes, kind, stream);
}

inline gpuError_t CountedMemset(void* dst, int value, size_t bytes,
                                gpuStream_t stream) {
  GpuCounters().Operation(DeviceOp::kMemset);
  return gpuMemsetAsync(dst, value, bytes, stream);
}

inline gpuError_t CountedSynchronize(gpuStream_t stream) {
  GpuCounters().Synchronized();
  return gpuStreamSynchronize(stream);
}

// One kernel queued by a launcher.
inline void CountKernel() { GpuCounters().Operation(DeviceOp::kKernel); }

}  // namespace packd::PACKD_GPU_NS

#endif  // PACKD_KERNELS_GPU_GPU_RUNTIME_H_
