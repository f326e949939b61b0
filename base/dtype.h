// DType: the ten element types of the wire contract (numbers equal
// packd.v1.DType), their item sizes and names.
//
//   DType t = DType::kBFloat16;
//   int64_t bytes = ItemSize(t) * n;  // 2 * n
#ifndef PACKD_BASE_DTYPE_H_
#define PACKD_BASE_DTYPE_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace packd {

// Values equal the packd.v1.DType enum numbers, so the codec converts by cast
// after a range check.
enum class DType : int {
  kUnspecified = 0,
  kBool = 1,
  kUInt8 = 2,
  kInt8 = 3,
  kInt16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kFloat16 = 7,
  kBFloat16 = 8,
  kFloat32 = 9,
  kFloat64 = 10,
};

inline constexpr DType kAllDTypes[] = {
    DType::kBool,    DType::kUInt8,  DType::kInt8,    DType::kInt16,
    DType::kInt32,   DType::kInt64,  DType::kFloat16, DType::kBFloat16,
    DType::kFloat32, DType::kFloat64};

// Returns true for the ten dtypes above, false for kUnspecified and
// out-of-range values.
bool IsValidDType(DType dtype);

// Returns the size of one element in bytes, or 0 for an invalid dtype.
int64_t ItemSize(DType dtype);

// Returns true for the floating-point dtypes, whose sign bit does not make a
// value nonzero.
bool IsFloatingPoint(DType dtype);

// The bits of an element of `dtype` that make it nonzero, as a mask counts
// it: all of them for integers and bool, all but the sign for floats (so -0.0
// is inactive and NaN active). 0 for an invalid dtype.
uint64_t NonzeroBits(DType dtype);

// How many of the `n` elements of `dtype` at `data` (host memory) are active:
// nonzero, as a mask counts them (NaN is active, -0.0 is not). 0 for an
// invalid dtype.
int64_t CountNonzero(DType dtype, const void* data, int64_t n);

// Returns the lower-case name ("bfloat16"); "unspecified" or "invalid"
// otherwise.
const char* DTypeName(DType dtype);

// Element k of an integer tensor's bytes (uint8, int8, int16, int32, int64),
// as int64.
int64_t IntegerAt(const void* data, DType dtype, int64_t k);

// Parses a name as DTypeName prints it (also "bf16", "fp16", "fp32", "half",
// "float", "double", "long", "int"). Returns false when the name is unknown.
bool ParseDType(absl::string_view name, DType* dtype);

}  // namespace packd

#endif  // PACKD_BASE_DTYPE_H_
