// Conversions between packd's TensorView and libtorch's at::Tensor (CPU),
// without copying.
//
// clang-format off
//   at::Tensor t = AsTensor(view);          // shares view.data
//   TensorView v = AsView(t.contiguous());  // shares t's storage; t must outlive v
// clang-format on
#ifndef PACKD_BASE_TORCH_INTEROP_H_
#define PACKD_BASE_TORCH_INTEROP_H_

#include <ATen/ATen.h>

#include "base/tensor_view.h"

namespace packd {

// The torch scalar type of a valid dtype.
at::ScalarType ToScalarType(DType dtype);
// The dtype of a torch scalar type; kUnspecified for one packd does not carry
// (complex, qint...).
DType FromScalarType(at::ScalarType type);

// A CPU tensor over view.data (not owned). view must be on cpu and valid.
at::Tensor AsTensor(const TensorView& view);
// A view of a contiguous CPU tensor's data.
TensorView AsView(const at::Tensor& tensor);

}  // namespace packd

#endif  // PACKD_BASE_TORCH_INTEROP_H_
