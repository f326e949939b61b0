// The backends and runtimes built into packd_kernels, in the order they are
// registered (the first of a kind is its default): the one place that names
// them (kernels/registry.h, RegisterBuiltinBackends).
#include "kernels/cpu/cpu_backend.h"
#include "kernels/device_runtime.h"
#include "kernels/registry.h"
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
#include "kernels/gpu/gpu_backend.h"
#endif
#ifdef PACKD_HAVE_TORCH
#include "kernels/torch/torch_backend.h"
#endif

namespace packd {

void RegisterBuiltinBackends(Registry& registry) {
  registry.SetRuntime(MakeHostRuntime());
  RegisterCpuBackends(registry);
#ifdef PACKD_HAVE_TORCH
  RegisterTorchBackends(registry);
#endif
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
  gpu::RegisterGpuBackends(registry);
#endif
}

}  // namespace packd
