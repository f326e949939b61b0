#include "proto/tensor_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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

namespace {

void EncodeFixed(const FixedLayout& fixed, v1::FixedLayout* out) {
  out->set_tokens(fixed.tokens);
  out->set_sequences(fixed.sequences);
  out->set_max_seqlen(fixed.max_seqlen);
}

FixedLayout DecodeFixed(const v1::FixedLayout& fixed) {
  return FixedLayout{fixed.tokens(), fixed.sequences(), fixed.max_seqlen()};
}

void EncodeShared(const std::optional<SharedPrefix>& shared,
                  v1::SharedPrefix* out) {
  out->mutable_groups()->Assign(shared->groups.begin(), shared->groups.end());
  out->mutable_prefix_lengths()->Assign(shared->prefix_lengths.begin(),
                                        shared->prefix_lengths.end());
  out->mutable_same_inputs()->Assign(shared->same_inputs.begin(),
                                     shared->same_inputs.end());
  out->set_targets(shared->targets);
}

std::optional<SharedPrefix> DecodeShared(bool present,
                                         const v1::SharedPrefix& shared) {
  if (!present) return std::nullopt;
  SharedPrefix out;
  out.groups.assign(shared.groups().begin(), shared.groups().end());
  out.prefix_lengths.assign(shared.prefix_lengths().begin(),
                            shared.prefix_lengths().end());
  out.same_inputs.assign(shared.same_inputs().begin(),
                         shared.same_inputs().end());
  out.targets = shared.targets();
  return out;
}

// The layout fields that place rows, which a Pack and a Scatter share
// (base/layout_options.h, ScatterFields), decoded and encoded.
template <typename Request>
LayoutOptions DecodePlacement(const Request& request) {
  LayoutOptions layout;
  layout.pad_multiple = request.pad_multiple();
  layout.cp_size = request.cp_size();
  layout.cp_rank = request.cp_rank();
  layout.sp_size = request.sp_size();
  layout.sp_rank = request.sp_rank();
  layout.fixed = DecodeFixed(request.fixed());
  layout.shared_prefix =
      DecodeShared(request.has_shared_prefix(), request.shared_prefix());
  return layout;
}

template <typename Request>
void EncodePlacement(const LayoutOptions& layout, Request* request) {
  request->set_pad_multiple(layout.pad_multiple);
  request->set_cp_size(layout.cp_size);
  request->set_cp_rank(layout.cp_rank);
  request->set_sp_size(layout.sp_size);
  request->set_sp_rank(layout.sp_rank);
  if (layout.fixed.any()) EncodeFixed(layout.fixed, request->mutable_fixed());
  if (layout.shared_prefix.has_value()) {
    EncodeShared(layout.shared_prefix, request->mutable_shared_prefix());
  }
}

}  // namespace

void EncodeLayout(const LayoutOptions& layout, v1::PackRequest* request) {
  EncodePlacement(layout, request);
  request->mutable_pad_values()->Assign(layout.pad_values.begin(),
                                        layout.pad_values.end());
  request->set_with_seq_idx(layout.with_seq_idx);
  request->clear_shifts();
  for (const Shift& shift : layout.shifts) {
    v1::Shift* s = request->add_shifts();
    s->set_input(shift.input);
    s->set_fill(shift.fill);
  }
}

absl::Status EncodeLayout(const LayoutOptions& layout,
                          v1::ScatterRequest* request) {
  PACKD_RETURN_IF_ERROR(CheckScatterFields(layout));
  EncodePlacement(layout, request);
  return absl::OkStatus();
}

void EncodeMRope(const MRopeOptions& mrope, v1::MRope* out) {
  out->set_input(mrope.input);
  out->set_image_token_id(mrope.image_token_id);
  out->set_video_token_id(mrope.video_token_id);
  out->set_vision_start_token_id(mrope.vision_start_token_id);
  out->set_spatial_merge_size(mrope.spatial_merge_size);
  out->clear_grids();
  for (const VisionGrid& grid : mrope.grids) {
    v1::VisionGrid* g = out->add_grids();
    g->set_t(grid.t);
    g->set_h(grid.h);
    g->set_w(grid.w);
  }
  out->set_tokens_per_second(mrope.tokens_per_second);
  out->mutable_seconds_per_grid()->Assign(mrope.seconds_per_grid.begin(),
                                          mrope.seconds_per_grid.end());
}

std::optional<MRopeOptions> DecodeMRope(const v1::PackRequest& request) {
  if (!request.has_mrope()) return std::nullopt;
  const v1::MRope& in = request.mrope();
  MRopeOptions mrope;
  mrope.input = in.input();
  mrope.image_token_id = in.image_token_id();
  mrope.video_token_id = in.video_token_id();
  mrope.vision_start_token_id = in.vision_start_token_id();
  mrope.spatial_merge_size = in.spatial_merge_size();
  for (const v1::VisionGrid& g : in.grids()) {
    mrope.grids.push_back(VisionGrid{g.t(), g.h(), g.w()});
  }
  mrope.tokens_per_second = in.tokens_per_second();
  mrope.seconds_per_grid.assign(in.seconds_per_grid().begin(),
                                in.seconds_per_grid().end());
  return mrope;
}

LayoutOptions DecodeLayout(const v1::PackRequest& request) {
  LayoutOptions layout = DecodePlacement(request);
  layout.pad_values.assign(request.pad_values().begin(),
                           request.pad_values().end());
  layout.with_seq_idx = request.with_seq_idx();
  for (const v1::Shift& shift : request.shifts()) {
    layout.shifts.push_back({shift.input(), shift.fill()});
  }
  return layout;
}

LayoutOptions DecodeLayout(const v1::ScatterRequest& request) {
  return DecodePlacement(request);
}

void EncodeSharedLayout(const SharedLayout& shared, v1::SharedLayout* out) {
  auto assign = [](const auto& from,
                   google::protobuf::RepeatedField<int64_t>* to) {
    to->Assign(from.begin(), from.end());
  };
  assign(shared.cu_seqlens_q, out->mutable_cu_seqlens_q());
  assign(shared.cu_seqlens_k, out->mutable_cu_seqlens_k());
  assign(shared.kv_index, out->mutable_kv_index());
  out->set_max_seqlen_q(shared.max_seqlen_q);
  out->set_max_seqlen_k(shared.max_seqlen_k);
  assign(shared.pred_index, out->mutable_pred_index());
  assign(shared.target_cu_seqlens, out->mutable_target_cu_seqlens());
  assign(shared.segment_row, out->mutable_segment_row());
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
