// The tensor codec: packd.v1.Tensor <-> TensorView, and absl::Status ->
// grpc::Status. Decoding validates before it touches a byte and never copies
// payload bytes: the view points into the request message or into a region.
//
//   PACKD_ASSIGN_OR_RETURN(TensorView mask,
//                          DecodeTensor(request.mask(), "mask", &regions,
//                          &held));
//   return ToGrpcStatus(status);
#ifndef PACKD_SERVER_TENSOR_CODEC_H_
#define PACKD_SERVER_TENSOR_CODEC_H_

#include <grpcpp/support/status.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "server/regions.h"

namespace packd {

// Returns a view of a tensor's bytes: inline `data` (a CPU view; `tensor` must
// outlive it) or a region slice resolved through `regions`, whose region is
// appended to `held` so that it stays mapped while the call runs.
// INVALID_ARGUMENT naming `field` when the dtype is unknown, a dim is negative,
// the byte size overflows int64, or the bytes given (`data`, or the slice's
// byte_size) are not exactly numel * itemsize; the region errors of
// RegionRegistry::Resolve; FAILED_PRECONDITION for a slice when `regions` is
// null or disabled.
absl::StatusOr<TensorView> DecodeTensor(
    const v1::Tensor& tensor, absl::string_view field,
    const RegionRegistry* regions, std::vector<std::shared_ptr<Region>>* held);

// Sets dtype and shape of `out` from `view` (not its bytes).
void EncodeTensorHeader(const TensorView& view, v1::Tensor* out);

// absl and gRPC codes are equal by number.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace packd

#endif  // PACKD_SERVER_TENSOR_CODEC_H_
