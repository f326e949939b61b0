#include "base/dtype.h"

#include <cstring>

namespace packd {

bool IsValidDType(DType dtype) {
  const int v = static_cast<int>(dtype);
  return v >= static_cast<int>(DType::kBool) &&
         v <= static_cast<int>(DType::kFloat64);
}

int64_t ItemSize(DType dtype) {
  switch (dtype) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
    case DType::kInt16:
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
    case DType::kUnspecified:
      break;
  }
  return 0;
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat32 || dtype == DType::kFloat64;
}

namespace {

// Elements of type U whose bits under `magnitude` (all but a float's sign)
// are not all zero; branch-free, so it vectorises.
template <typename U>
int64_t CountNonzeroAs(const void* data, int64_t n, U magnitude) {
  int64_t count = 0;
  const char* p = static_cast<const char*>(data);
  for (int64_t i = 0; i < n; ++i) {
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    count += (v & magnitude) != 0;
  }
  return count;
}

}  // namespace

uint64_t NonzeroBits(DType dtype) {
  const int64_t bits = 8 * ItemSize(dtype);
  if (bits == 0) return 0;
  const uint64_t all = bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
  return IsFloatingPoint(dtype) ? all >> 1 : all;
}

int64_t CountNonzero(DType dtype, const void* data, int64_t n) {
  const uint64_t bits = NonzeroBits(dtype);
  switch (ItemSize(dtype)) {
    case 1:
      return CountNonzeroAs<uint8_t>(data, n, static_cast<uint8_t>(bits));
    case 2:
      return CountNonzeroAs<uint16_t>(data, n, static_cast<uint16_t>(bits));
    case 4:
      return CountNonzeroAs<uint32_t>(data, n, static_cast<uint32_t>(bits));
    case 8:
      return CountNonzeroAs<uint64_t>(data, n, bits);
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kUnspecified:
      return "unspecified";
  }
  return "invalid";
}

bool ParseDType(absl::string_view name, DType* dtype) {
  struct Alias {
    const char* name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"bf16", DType::kBFloat16},  {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},   {"fp32", DType::kFloat32},
      {"float", DType::kFloat32},  {"fp64", DType::kFloat64},
      {"double", DType::kFloat64}, {"long", DType::kInt64},
      {"int", DType::kInt32},
  };
  for (DType d : kAllDTypes) {
    if (name == DTypeName(d)) {
      *dtype = d;
      return true;
    }
  }
  for (const Alias& a : kAliases) {
    if (name == a.name) {
      *dtype = a.dtype;
      return true;
    }
  }
  return false;
}

int64_t IntegerAt(const void* data, DType dtype, int64_t k) {
  switch (dtype) {
    case DType::kUInt8:
      return static_cast<const uint8_t*>(data)[k];
    case DType::kInt8:
      return static_cast<const int8_t*>(data)[k];
    case DType::kInt16:
      return static_cast<const int16_t*>(data)[k];
    case DType::kInt32:
      return static_cast<const int32_t*>(data)[k];
    default:
      return static_cast<const int64_t*>(data)[k];
  }
}

}  // namespace packd
