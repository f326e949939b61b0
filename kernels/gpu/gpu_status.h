// Runtime errors of the GPU sources as absl::Status: out-of-memory becomes
// RESOURCE_EXHAUSTED, anything else INTERNAL with the runtime's own message.
//
//   PACKD_GPU_CHECK("device allocation", gpuMalloc(&data, bytes));
#ifndef PACKD_KERNELS_GPU_GPU_STATUS_H_
#define PACKD_KERNELS_GPU_GPU_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/gpu/gpu_runtime.h"

namespace packd::gpu {

inline absl::Status RuntimeError(const char* what, gpuError_t err) {
  if (err == gpuErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": out of device memory (", gpuGetErrorString(err), ")"));
  }
  return absl::InternalError(absl::StrCat(PACKD_GPU_RUNTIME_NAME, " ", what,
                                          ": ", gpuGetErrorString(err)));
}

}  // namespace packd::gpu

// Returns the error of `expr`, described by `what`, from the enclosing
// function.
#define PACKD_GPU_CHECK(what, expr)                        \
  do {                                                     \
    const gpuError_t packd_err_ = (expr);                  \
    if (packd_err_ != gpuSuccess) {                        \
      return ::packd::gpu::RuntimeError(what, packd_err_); \
    }                                                      \
  } while (false)

#endif  // PACKD_KERNELS_GPU_GPU_STATUS_H_
