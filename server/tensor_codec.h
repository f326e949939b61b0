// The tensor codec: packd.v1.Tensor <-> TensorView, and absl::Status ->
// grpc::Status. Decoding validates before it touches a byte and never copies
// payload bytes: the view points into the request message.
//
//   PACKD_ASSIGN_OR_RETURN(TensorView mask, DecodeInlineTensor(request.mask(),
//   "mask")); return ToGrpcStatus(status);
#ifndef PACKD_SERVER_TENSOR_CODEC_H_
#define PACKD_SERVER_TENSOR_CODEC_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor_view.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

// Returns a CPU view of an inline tensor's bytes (`tensor` must outlive it).
// INVALID_ARGUMENT naming `field` when the dtype is unknown, a dim is negative,
// the byte size overflows int64, or `data` is not exactly numel * itemsize
// bytes. FAILED_PRECONDITION when the tensor is a region handle and the caller
// does not resolve handles.
absl::StatusOr<TensorView> DecodeInlineTensor(const v1::Tensor& tensor,
                                              absl::string_view field);

// Sets dtype and shape of `out` from `view` (not its bytes).
void EncodeTensorHeader(const TensorView& view, v1::Tensor* out);

// absl and gRPC codes are equal by number.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace packd

#endif  // PACKD_SERVER_TENSOR_CODEC_H_
