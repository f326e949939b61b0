#include "service/call_spec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// The headers' valid views, an invalid one as a view of no bytes.
std::vector<TensorView> ValidHeaders(
    const std::vector<absl::StatusOr<TensorView>>& headers) {
  std::vector<TensorView> views;
  views.reserve(headers.size());
  for (const absl::StatusOr<TensorView>& h : headers) {
    views.push_back(h.ok() ? *h : TensorView{});
  }
  return views;
}

// The headers of the mask, `tensors` (named `field`) and the segment ids.
template <typename Request>
void DecodeHeaders(
    const Request& request,
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
    absl::string_view field, CallSpec* spec) {
  spec->mask =
      DecodeTensorHeader(request.mask(), absl::StrCat(spec->prefix, "mask"));
  spec->tensors.reserve(tensors.size());
  for (int i = 0; i < tensors.size(); ++i) {
    spec->tensors.push_back(DecodeTensorHeader(
        tensors[i], absl::StrCat(spec->prefix, field, "[", i, "]")));
  }
  if (request.has_segment_ids()) {
    spec->segment_ids = DecodeTensorHeader(
        request.segment_ids(), absl::StrCat(spec->prefix, "segment_ids"));
  }
  spec->to_outputs = !request.outputs().empty();
}

}  // namespace

CallSpec CallSpec::Of(const v1::PackRequest& request, absl::string_view prefix,
                      int64_t max_message_bytes, const Tenant& tenant) {
  CallSpec spec;
  spec.tenant = tenant;
  spec.op = Op::kPack;
  spec.prefix = std::string(prefix);
  DecodeHeaders(request, request.inputs(), "inputs", &spec);
  spec.results = request.inputs_size() + request.shifts_size();
  spec.layout = DecodeLayout(request);
  spec.layout.max_rows = MaxEntriesPerMessage(max_message_bytes);
  spec.with_position_ids = request.with_position_ids();
  spec.with_token_mask = request.with_token_mask();
  spec.mrope = DecodeMRope(request);
  spec.sizes = PackSizes::Of(
      ValidHeaders(spec.tensors), spec.layout,
      {spec.with_position_ids, spec.with_token_mask, spec.mrope.has_value()});
  return spec;
}

CallSpec CallSpec::Of(const v1::ScatterRequest& request,
                      absl::string_view prefix, int64_t max_message_bytes,
                      const Tenant& tenant) {
  CallSpec spec;
  spec.tenant = tenant;
  spec.op = Op::kScatter;
  spec.prefix = std::string(prefix);
  DecodeHeaders(request, request.packed(), "packed", &spec);
  spec.results = request.packed_size();
  spec.layout = DecodeLayout(request);
  spec.layout.max_rows = MaxEntriesPerMessage(max_message_bytes);
  if (request.has_tail_shape()) {
    spec.tail_shape.emplace(request.tail_shape().dims().begin(),
                            request.tail_shape().dims().end());
  }
  return spec;
}

CallSpec CallSpec::OfRows(absl::Span<const int64_t> rows,
                          const GridsByRow& grids) const {
  CallSpec spec = *this;
  const int64_t count = static_cast<int64_t>(rows.size());
  auto resize = [count](absl::StatusOr<TensorView>& header) {
    if (header.ok() && !header->shape.empty()) header->shape[0] = count;
  };
  resize(spec.mask);
  for (absl::StatusOr<TensorView>& t : spec.tensors) resize(t);
  if (spec.segment_ids.has_value()) resize(*spec.segment_ids);
  if (layout.shared_prefix.has_value()) {
    const SharedPrefix& shared = *layout.shared_prefix;
    SharedPrefix mine{{}, {}, shared.same_inputs};
    for (int64_t b : rows) {
      mine.groups.push_back(shared.groups[b]);
      mine.prefix_lengths.push_back(shared.prefix_lengths[b]);
    }
    spec.layout.shared_prefix = std::move(mine);
  }
  if (mrope.has_value()) spec.mrope = MRopeOfRows(*mrope, grids, rows);
  return spec;
}

int64_t CallSpec::ResultBytes(int64_t active) const {
  if (to_outputs) return 0;
  const bool batch = mask.ok() && mask->shape.size() == 2;
  if (op == Op::kScatter) {
    if (!batch) return 0;
    return ScatterResultBytes(
        ValidHeaders(tensors),
        SaturatingMul(std::max<int64_t>(0, mask->shape[0]),
                      std::max<int64_t>(0, mask->shape[1])));
  }
  if (active < 0 || !batch) return sizes.ResultBytes(-1);
  // Sequences: the rows, or with documents at most one per active token.
  const int64_t sequences =
      segment_ids.has_value() ? active : std::max<int64_t>(0, mask->shape[0]);
  return sizes.ResultBytes(sizes.MaxRows(active, sequences));
}

int64_t CallSpec::ReservedBytes(int64_t batch_rows) const {
  return op == Op::kPack ? BatchMetadataBytes(batch_rows) : 0;
}

namespace {

// An op's options over `base`: the call's segment ids and layout.
template <typename Options>
Options OptionsOver(const CallOptions& base,
                    const std::optional<TensorView>& segment_ids,
                    const LayoutOptions& layout) {
  Options options;
  static_cast<CallOptions&>(options) = base;
  options.segment_ids = segment_ids;
  options.layout = layout;
  return options;
}

}  // namespace

PackOptions CallSpec::PackOptionsFor(
    const CallOptions& base,
    const std::optional<TensorView>& segment_ids) const {
  PackOptions options = OptionsOver<PackOptions>(base, segment_ids, layout);
  options.with_position_ids = with_position_ids;
  options.with_token_mask = with_token_mask;
  options.mrope = mrope;
  return options;
}

ScatterOptions CallSpec::ScatterOptionsFor(
    const CallOptions& base,
    const std::optional<TensorView>& segment_ids) const {
  ScatterOptions options =
      OptionsOver<ScatterOptions>(base, segment_ids, layout);
  options.tail_shape = tail_shape;
  return options;
}

}  // namespace packd
