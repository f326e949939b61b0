// The CUDA driver's answer to "which allocation holds this address", reached
// through the runtime's entry-point query so that nothing links the
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

// The allocation holding `p`: the driver's cuMemGetAddressRange, else its
// cuPointerGetAttribute ranges (RANGE_START_ADDR, RANGE_SIZE), which the
// driver documents for every kind of device pointer, memory opened from an IPC
// handle included. cudaErrorNotSupported when the driver has neither;
// cudaErrorInvalidValue when both fail, with `driver_result` (when given) set
// to the last CUresult (0 on success).
inline cudaError_t CudaMemGetAddressRange(void** base, size_t* size,
                                          const void* p,
                                          int* driver_result = nullptr) {
  using RangeFn = int (*)(unsigned long long*, size_t*, unsigned long long);
  using AttributeFn = int (*)(void*, int, unsigned long long);
  auto entry = [](const char* name) -> void* {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return f;
  };
  static const RangeFn range =
      reinterpret_cast<RangeFn>(entry("cuMemGetAddressRange"));
  static const AttributeFn attribute =
      reinterpret_cast<AttributeFn>(entry("cuPointerGetAttribute"));
  if (range == nullptr && attribute == nullptr) return cudaErrorNotSupported;
  const auto address = reinterpret_cast<unsigned long long>(p);
  int result = -1;
  unsigned long long b = 0;
  if (range != nullptr && (result = range(&b, size, address)) == 0) {
    *base = reinterpret_cast<void*>(b);
  } else if (attribute != nullptr) {
    constexpr int kRangeStartAddr =
        11;                         // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
    constexpr int kRangeSize = 12;  // CU_POINTER_ATTRIBUTE_RANGE_SIZE
    void* start = nullptr;
    size_t bytes = 0;
    result = attribute(&start, kRangeStartAddr, address);
    if (result == 0) result = attribute(&bytes, kRangeSize, address);
    if (result == 0) {
      *base = start;
      *size = bytes;
    }
  }
  if (driver_result != nullptr) *driver_result = result;
  return result == 0 ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace packd

#endif  // PACKD_BASE_CUDA_ADDRESS_RANGE_H_
