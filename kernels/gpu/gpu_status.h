// Runtime errors of the GPU sources as absl::Status.
//
//   PACKD_GPU_CHECK("device allocation", gpuMalloc(&data, bytes));
#ifndef PACKD_KERNELS_GPU_GPU_STATUS_H_
#define PACKD_KERNELS_GPU_GPU_STATUS_H_

#include "absl/status/status.h"
#include "kernels/gpu/gpu_runtime.h"

namespace packd::PACKD_GPU_NS {

// The status of the failed runtime call `what`: RESOURCE_EXHAUSTED for out of
// memory, INTERNAL otherwise, with the runtime's own words. It also clears the
// calling thread's last error, so that this failure does not surface again in
// a later, unrelated call on the same thread; and when the current device no
// longer answers afterwards (a sticky error: its context is lost), it marks
// the device lost, which the GPU runtime's CheckDevice then reports.
absl::Status RuntimeError(const char* what, gpuError_t err);

}  // namespace packd::PACKD_GPU_NS

// Returns the error of `expr`, described by `what`, from the enclosing
// function.
#define PACKD_GPU_CHECK(what, expr)                                 \
  do {                                                              \
    const gpuError_t packd_err_ = (expr);                           \
    if (packd_err_ != gpuSuccess) {                                 \
      return ::packd::PACKD_GPU_NS::RuntimeError(what, packd_err_); \
    }                                                               \
  } while (false)

#endif  // PACKD_KERNELS_GPU_GPU_STATUS_H_
