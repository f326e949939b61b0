// The tensor codec: packd.v1.Tensor headers (dtype and shape) to and from
// packd's own types, inline tensors, and absl::Status <-> grpc::Status. The
// one home of these rules for the server, both C++ clients, the tests and the
// benchmarks.
//
// clang-format off
//   EncodeTensorHeader(DType::kBFloat16, {16, 1024, 4096}, request.add_inputs());
//   PACKD_ASSIGN_OR_RETURN(TensorView view, DecodeTensorHeader(request.mask(), "mask"));
//   reactor->Finish(ToGrpcStatus(status));
// clang-format on
#ifndef PACKD_PROTO_TENSOR_CODEC_H_
#define PACKD_PROTO_TENSOR_CODEC_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/layout_options.h"
#include "base/mrope_options.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

// Sets dtype and shape of `out` (not its bytes).
void EncodeTensorHeader(DType dtype, absl::Span<const int64_t> shape,
                        v1::Tensor* out);

// Sets dtype, shape and the inline bytes [data, data + bytes) of `out`.
void EncodeInlineTensor(DType dtype, absl::Span<const int64_t> shape,
                        const void* data, int64_t bytes, v1::Tensor* out);

// A view with the dtype and shape of `tensor` (no data, on cpu), checked.
// INVALID_ARGUMENT naming `field` when the dtype is not a supported one, a dim
// is negative, or the byte size overflows int64.
absl::StatusOr<TensorView> DecodeTensorHeader(const v1::Tensor& tensor,
                                              absl::string_view field);

// A layout's fields (docs/design.md §10) on a request, and back. A Scatter
// carries only those that place rows: encoding pad_values, shifts or
// with_seq_idx into one is INVALID_ARGUMENT.
void EncodeLayout(const LayoutOptions& layout, v1::PackRequest* request);
absl::Status EncodeLayout(const LayoutOptions& layout,
                          v1::ScatterRequest* request);
LayoutOptions DecodeLayout(const v1::PackRequest& request);
LayoutOptions DecodeLayout(const v1::ScatterRequest& request);

// Multimodal rotary positions' options (docs/design.md §17) on a request, and
// back: nullopt when the request has none.
void EncodeMRope(const MRopeOptions& mrope, v1::MRope* out);
std::optional<MRopeOptions> DecodeMRope(const v1::PackRequest& request);

// A shared stream's metadata (docs/design.md §14) into a PackResponse.shared.
void EncodeSharedLayout(const SharedLayout& shared, v1::SharedLayout* out);

// A status across gRPC: absl and gRPC codes are equal by number.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace packd

#endif  // PACKD_PROTO_TENSOR_CODEC_H_
