#include "base/torch_interop.h"

#include <vector>

namespace packd {

at::ScalarType ToScalarType(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return at::kBool;
    case DType::kUInt8:
      return at::kByte;
    case DType::kInt8:
      return at::kChar;
    case DType::kInt16:
      return at::kShort;
    case DType::kInt32:
      return at::kInt;
    case DType::kInt64:
      return at::kLong;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kUnspecified:
      break;
  }
  return at::ScalarType::Undefined;
}

DType FromScalarType(at::ScalarType type) {
  for (DType d : kAllDTypes) {
    if (ToScalarType(d) == type) return d;
  }
  return DType::kUnspecified;
}

at::Tensor AsTensor(const TensorView& view) {
  std::vector<int64_t> sizes(view.shape.begin(), view.shape.end());
  // from_blob rejects a null pointer even for zero elements; any aligned
  // address will do then.
  alignas(16) static char empty[16];
  void* data = view.data != nullptr ? view.data : empty;
  return at::from_blob(data, sizes,
                       at::TensorOptions().dtype(ToScalarType(view.dtype)));
}

TensorView AsView(const at::Tensor& tensor) {
  TensorView view;
  view.data = tensor.data_ptr();
  view.dtype = FromScalarType(tensor.scalar_type());
  view.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  return view;
}

}  // namespace packd
