// Device, Shape and TensorView: a non-owning description of a dense,
// C-contiguous tensor in host or device memory (like DLPack's DLTensor), plus
// checked size arithmetic.
//
//   TensorView x{bytes.data(), DType::kBFloat16, {16, 1024, 4096}};
//   PACKD_ASSIGN_OR_RETURN(int64_t n, ByteSize(x.dtype, x.shape, "inputs[0]"));
#ifndef PACKD_BASE_TENSOR_VIEW_H_
#define PACKD_BASE_TENSOR_VIEW_H_

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace packd {

enum class DeviceKind { kCpu, kCuda, kHip };

// Where a tensor lives: "cpu", "cuda:N" or "hip:N".
struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device Cpu() { return Device{}; }
  bool operator==(const Device& o) const {
    return kind == o.kind && index == o.index;
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
  // "cpu", "cuda:0", "hip:1".
  std::string ToString() const;
};

// Parses "cpu", "cuda:N" or "hip:N" (N a decimal in [0, 1023]); "cuda" and
// "hip" mean index 0. Returns INVALID_ARGUMENT naming `field` and the text for
// anything else. Whether the device exists is the registry's question, not this
// one's.
absl::StatusOr<Device> ParseDevice(absl::string_view text,
                                   absl::string_view field = "device");

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" from a runtime's 16 UUID bytes
// (cudaUUID_t, hipUUID): the form nvidia-smi prints and torch's
// get_device_properties(i).uuid carries after "GPU-".
std::string FormatDeviceUuid(const unsigned char bytes[16]);

// A UUID as clients may send it, in FormatDeviceUuid's form: "GPU-" added
// when absent, hex digits lowercased.
std::string CanonicalDeviceUuid(absl::string_view uuid);

using Shape = absl::InlinedVector<int64_t, 6>;

// "[4, 16, 8]".
std::string ShapeString(absl::Span<const int64_t> shape);

// Returns the product of `shape`. INVALID_ARGUMENT naming `field` when a dim is
// negative or the product overflows int64.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape,
                                    absl::string_view field);

// Returns NumElements * ItemSize(dtype), checked. INVALID_ARGUMENT naming
// `field` for an invalid dtype, a negative dim or an overflow.
absl::StatusOr<int64_t> ByteSize(DType dtype, absl::Span<const int64_t> shape,
                                 absl::string_view field);

// A dense, row-major tensor that someone else owns. `data` may be null only
// when it holds no bytes.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kUnspecified;
  Shape shape;
  Device device;

  // Product of dims; callers validate first (ByteSize), so this does not check
  // for overflow.
  int64_t numel() const;
  int64_t nbytes() const { return numel() * ItemSize(dtype); }
};

// Checked int64 arithmetic: returns false on overflow and leaves *out
// unspecified.
inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace packd

#endif  // PACKD_BASE_TENSOR_VIEW_H_
