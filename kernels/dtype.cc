#include "kernels/dtype.h"

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

}  // namespace packd
