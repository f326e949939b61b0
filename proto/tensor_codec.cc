#include "proto/tensor_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace packd {

void EncodeTensorHeader(DType dtype, absl::Span<const int64_t> shape,
                        v1::Tensor* out) {
  out->set_dtype(static_cast<v1::DType>(dtype));
  out->mutable_shape()->Assign(shape.begin(), shape.end());
}

void EncodeInlineTensor(DType dtype, absl::Span<const int64_t> shape,
                        const void* data, int64_t bytes, v1::Tensor* out) {
  EncodeTensorHeader(dtype, shape, out);
  out->set_data(static_cast<const char*>(data), static_cast<size_t>(bytes));
}

absl::StatusOr<TensorView> DecodeTensorHeader(const v1::Tensor& tensor,
                                              absl::string_view field) {
  TensorView view;
  view.dtype = static_cast<DType>(tensor.dtype());
  if (!IsValidDType(view.dtype)) {
    const std::string name = v1::DType_IsValid(tensor.dtype())
                                 ? v1::DType_Name(tensor.dtype())
                                 : absl::StrCat(tensor.dtype());
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype ", name, " is not a supported dtype"));
  }
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  PACKD_RETURN_IF_ERROR(ByteSize(view.dtype, view.shape, field).status());
  return view;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace packd
