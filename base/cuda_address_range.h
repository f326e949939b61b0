// The CUDA driver's cuMemGetAddressRange (the allocation holding an address),
// reached through the runtime's entry-point query so that nothing links the
// driver library, which is absent where there is no GPU. Shared by the server's
// GPU runtime and the client's CUDA device memory.
//
//   void* base; size_t size;
//   if (CudaMemGetAddressRange(&base, &size, p) == cudaSuccess) ...
#ifndef PACKD_BASE_CUDA_ADDRESS_RANGE_H_
#define PACKD_BASE_CUDA_ADDRESS_RANGE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace packd {

// cudaErrorNotSupported when the driver lacks it; cudaErrorInvalidValue when
// `p` is not in device memory.
inline cudaError_t CudaMemGetAddressRange(void** base, size_t* size,
                                          const void* p) {
  using Fn = int (*)(unsigned long long*, size_t*, unsigned long long);
  static const Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return cudaErrorNotSupported;
  unsigned long long b = 0;
  if (fn(&b, size, reinterpret_cast<unsigned long long>(p)) != 0) {
    return cudaErrorInvalidValue;
  }
  *base = reinterpret_cast<void*>(b);
  return cudaSuccess;
}

}  // namespace packd

#endif  // PACKD_BASE_CUDA_ADDRESS_RANGE_H_
