// The GPU backend ("gpu" on cuda:N, or on hip:N in a ROCm build): the mask
// scan, gather and scatter of gpu_kernels.cu, queued on the call's stream, with
// the scan's work arrays from the GPU runtime (gpu_device_runtime.h).
//
// clang-format off
//   gpu::RegisterGpuBackends(Registry::Global());  // Registry::Global() does this
//   Pack({x_on_cuda0}, mask_on_cuda0);
// clang-format on
#ifndef PACKD_KERNELS_GPU_GPU_BACKEND_H_
#define PACKD_KERNELS_GPU_GPU_BACKEND_H_

namespace packd {

class Registry;

namespace gpu {
// Sets the GPU runtime of cuda (CUDA build) or hip (ROCm build) and adds the
// "gpu" backend there, as the default.
void RegisterGpuBackends(Registry& registry);
}  // namespace gpu

namespace fake_gpu {
// The same sources built over the tests' fake GPU (tests/fake_gpu/): runtime
// and backend ("fake-gpu") on cuda, replacing whatever cuda had.
void RegisterGpuBackends(Registry& registry);
}  // namespace fake_gpu

}  // namespace packd

#endif  // PACKD_KERNELS_GPU_GPU_BACKEND_H_
