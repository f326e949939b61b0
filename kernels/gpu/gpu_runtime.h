// The one place CUDA and HIP differ: gpu* names for the runtime API, so that
// the GPU sources (gpu_kernels.cu, gpu_backend.cc, gpu_device_runtime.cc) build
// for CUDA (nvcc, default) and for ROCm (hipcc, PACKD_GPU_HIP defined).
//
// clang-format off
//   gpuError_t err = gpuMemcpyAsync(dst, src, n, gpuMemcpyDeviceToDevice, stream);
//   if (err != gpuSuccess) return gpuGetErrorString(err);
// clang-format on
//
// Each runtime below says how its names are spelled (PACKD_GPU_API for
// functions, PACKD_GPU_CONSTANT for values, PACKD_GPU_TYPE for types) and
// defines the few that are spelled otherwise; the one list of gpu* names
// after them serves all three.
#ifndef PACKD_KERNELS_GPU_GPU_RUNTIME_H_
#define PACKD_KERNELS_GPU_GPU_RUNTIME_H_

#if defined(PACKD_GPU_FAKE)

// A stand-in runtime in host memory with CUDA's semantics, for tests of the
// GPU path without a GPU: the build that defines PACKD_GPU_FAKE names its
// header in PACKD_GPU_FAKE_RUNTIME_H (tests/fake_gpu/CMakeLists.txt).
#include PACKD_GPU_FAKE_RUNTIME_H

#define PACKD_GPU_NS fake_gpu
#define PACKD_GPU_RUNTIME_NAME "fake GPU"
#define PACKD_GPU_API(name) fakegpu::name
#define PACKD_GPU_CONSTANT(name) fakegpu::k##name
#define PACKD_GPU_TYPE(name) fakegpu::name
using gpuDeviceProp_t = fakegpu::DeviceProp;
#define gpuMallocHost fakegpu::MallocHost
#define gpuFreeHost fakegpu::FreeHost
#define gpuErrorMemoryAllocation fakegpu::kErrorMemoryAllocation

inline fakegpu::Error gpuMemGetAddressRange(void** base, size_t* size,
                                            const void* p) {
  return fakegpu::MemGetAddressRange(base, size, p);
}
inline fakegpu::Error gpuPointerGetDevice(int* device, const void* p) {
  return fakegpu::PointerGetDevice(device, p);
}
inline fakegpu::Error gpuDeviceUuid(unsigned char out[16], int device) {
  fakegpu::DeviceProp prop;
  const fakegpu::Error err = fakegpu::GetDeviceProperties(&prop, device);
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
#define PACKD_GPU_API(name) hip##name
#define PACKD_GPU_CONSTANT(name) hip##name
#define PACKD_GPU_TYPE(name) hip##name##_t
using gpuDeviceProp_t = hipDeviceProp_t;
#define gpuMallocHost hipHostMalloc
#define gpuFreeHost hipHostFree
#define gpuErrorMemoryAllocation hipErrorOutOfMemory

inline hipError_t gpuMemGetAddressRange(void** base, size_t* size,
                                        const void* p) {
  hipDeviceptr_t b = nullptr;
  const hipError_t err = hipMemGetAddressRange(&b, size, const_cast<void*>(p));
  *base = b;
  return err;
}
inline hipError_t gpuPointerGetDevice(int* device, const void* p) {
  hipPointerAttribute_t attributes;
  const hipError_t err = hipPointerGetAttributes(&attributes, p);
  *device = attributes.device;
  return err;
}
inline hipError_t gpuDeviceUuid(unsigned char out[16], int device) {
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
#define PACKD_GPU_API(name) cuda##name
#define PACKD_GPU_CONSTANT(name) cuda##name
#define PACKD_GPU_TYPE(name) cuda##name##_t
using gpuDeviceProp_t = cudaDeviceProp;
#define gpuMallocHost cudaMallocHost
#define gpuFreeHost cudaFreeHost
#define gpuErrorMemoryAllocation cudaErrorMemoryAllocation

// The driver's cuMemGetAddressRange, reached through the runtime so that packd
// does not link the driver library (absent where there is no GPU).
cudaError_t gpuMemGetAddressRange(void** base, size_t* size, const void* p);
inline cudaError_t gpuPointerGetDevice(int* device, const void* p) {
  cudaPointerAttributes attributes;
  const cudaError_t err = cudaPointerGetAttributes(&attributes, p);
  *device = attributes.device;
  return err;
}
inline cudaError_t gpuDeviceUuid(unsigned char out[16], int device) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  for (int i = 0; i < 16; ++i)
    out[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
  return err;
}

#endif

// The names every runtime has, spelled as above (the fake GPU has no
// EventElapsedTime: gpu_check.cu, which times kernels, needs a device).
using gpuError_t = PACKD_GPU_TYPE(Error);
using gpuStream_t = PACKD_GPU_TYPE(Stream);
using gpuEvent_t = PACKD_GPU_TYPE(Event);
using gpuIpcMemHandle_t = PACKD_GPU_TYPE(IpcMemHandle);
constexpr gpuError_t gpuSuccess = PACKD_GPU_CONSTANT(Success);
#define gpuGetErrorString PACKD_GPU_API(GetErrorString)
#define gpuGetLastError PACKD_GPU_API(GetLastError)
#define gpuGetDeviceCount PACKD_GPU_API(GetDeviceCount)
#define gpuSetDevice PACKD_GPU_API(SetDevice)
#define gpuGetDevice PACKD_GPU_API(GetDevice)
#define gpuGetDeviceProperties PACKD_GPU_API(GetDeviceProperties)
#define gpuMalloc PACKD_GPU_API(Malloc)
#define gpuFree PACKD_GPU_API(Free)
#define gpuMemGetInfo PACKD_GPU_API(MemGetInfo)
#define gpuMemcpyAsync PACKD_GPU_API(MemcpyAsync)
#define gpuMemsetAsync PACKD_GPU_API(MemsetAsync)
#define gpuMemcpyHostToDevice PACKD_GPU_CONSTANT(MemcpyHostToDevice)
#define gpuMemcpyDeviceToHost PACKD_GPU_CONSTANT(MemcpyDeviceToHost)
#define gpuMemcpyDeviceToDevice PACKD_GPU_CONSTANT(MemcpyDeviceToDevice)
#define gpuStreamCreateWithFlags PACKD_GPU_API(StreamCreateWithFlags)
#define gpuStreamSynchronize PACKD_GPU_API(StreamSynchronize)
#define gpuStreamNonBlocking PACKD_GPU_CONSTANT(StreamNonBlocking)
#define gpuEventCreate PACKD_GPU_API(EventCreate)
#define gpuEventRecord PACKD_GPU_API(EventRecord)
#define gpuEventSynchronize PACKD_GPU_API(EventSynchronize)
#define gpuEventElapsedTime PACKD_GPU_API(EventElapsedTime)
#define gpuIpcOpenMemHandle PACKD_GPU_API(IpcOpenMemHandle)
#define gpuIpcCloseMemHandle PACKD_GPU_API(IpcCloseMemHandle)
#define gpuIpcMemLazyEnablePeerAccess \
  PACKD_GPU_CONSTANT(IpcMemLazyEnablePeerAccess)

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
