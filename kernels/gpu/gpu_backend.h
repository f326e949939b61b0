// The GPU backend ("gpu" on cuda:N, or on hip:N in a ROCm build): the mask
// scan, gather and scatter of gpu_kernels.cu on the device's default stream,
// device memory from a per-device pool, host transfers staged through pinned
// buffers, and IPC memory for device regions.
//
//   RegisterGpuBackends(Registry::Global());  // done by Registry::Global()
//   itself Pack(mask_on_cuda0, {x_on_cuda0});
#ifndef PACKD_KERNELS_GPU_GPU_BACKEND_H_
#define PACKD_KERNELS_GPU_GPU_BACKEND_H_

namespace packd {

class Registry;

// Adds the "gpu" backend for cuda (CUDA build) or hip (ROCm build).
void RegisterGpuBackends(Registry& registry);

}  // namespace packd

#endif  // PACKD_KERNELS_GPU_GPU_BACKEND_H_
