// CallSpec: one Pack or Scatter call (or a step's batch) as packd knows it
// between the wire and the op library, built once where its request is parsed:
// the tensors' headers (dtype and shape, no data), the layout, and the sizes
// its results take (kernels/pack_sizes.h). Admission reads its result bytes
// from it, the decoder attaches the tensors' bytes and regions to its headers
// (service/request_decoder.h), and the op's options are its methods. A step
// makes one for its batch and derives each micro-batch's from it (OfRows).
//
// clang-format off
//   const CallSpec spec = CallSpec::Of(request.message(), "", max_message_bytes, tenant);
//   hold(spec.ResultBytes(active));
//   PACKD_ASSIGN_OR_RETURN(DecodedCall call, decoder.Decode(request, spec));
//   Pack(call.tensors, call.mask, spec.PackOptionsFor(base, call.segment_ids));
// clang-format on
#ifndef PACKD_SERVICE_CALL_SPEC_H_
#define PACKD_SERVICE_CALL_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/layout_options.h"
#include "base/tensor_view.h"
#include "kernels/mrope.h"
#include "kernels/pack.h"
#include "kernels/pack_sizes.h"
#include "packd/v1/pack_service.pb.h"
#include "service/tenant.h"

namespace packd {

// Plain values; safe to share across threads once built.
struct CallSpec {
  enum class Op { kPack, kScatter };

  Op op = Op::kPack;
  // What the request's fields are called in errors: "" or "batch." before
  // each name.
  std::string prefix;
  // The headers of the mask and the tensors (Pack's inputs, Scatter's
  // packed), in request order, and of the segment ids when the request has
  // them: decoded once, no data. One that is not valid keeps its error, which
  // names its field, until the decoder reaches it in its order.
  absl::StatusOr<TensorView> mask;
  std::vector<absl::StatusOr<TensorView>> tensors;
  std::optional<absl::StatusOr<TensorView>> segment_ids;
  // How many results the call has: its tensors, then (Pack) one per shift.
  int results = 0;
  // The layout, decoded once, its rows bounded by what a response can hold
  // (Scatter's: the fields that place rows only, as DecodeLayout reads them).
  LayoutOptions layout;
  bool with_position_ids = false;
  // Pack's token mask and multimodal positions, when asked for.
  bool with_token_mask = false;
  std::optional<MRopeOptions> mrope;
  // Scatter's tail_shape, when given.
  std::optional<Shape> tail_shape;
  // Pack's sizes, over the valid headers (an invalid one counts as empty).
  PackSizes sizes;
  // Whether the results go to the request's outputs (no inline results).
  bool to_outputs = false;
  // Whose call it is: the regions it names are this tenant's.
  Tenant tenant;

  // The spec of `request`, whose regions are `tenant`'s.
  static CallSpec Of(const v1::PackRequest& request, absl::string_view prefix,
                     int64_t max_message_bytes, const Tenant& tenant);
  static CallSpec Of(const v1::ScatterRequest& request,
                     absl::string_view prefix, int64_t max_message_bytes,
                     const Tenant& tenant);

  // "Pack" or "Scatter".
  const char* method() const { return op == Op::kPack ? "Pack" : "Scatter"; }

  // The spec of rows `rows` of the batch, in that order, as a batch of their
  // own (a step's micro-batch): the same tensors with rows.size() rows, the
  // shared prefix's groups and prompts of those rows, and with mrope their
  // vision grids (`grids`: the batch's runs by row, VisionRunsByRow; unread
  // without mrope).
  CallSpec OfRows(absl::Span<const int64_t> rows,
                  const GridsByRow& grids) const;

  // The most bytes of the call's inline results (0 when they go to outputs):
  // Pack's, the rows its layout can have for `active` positions (-1: the
  // mask is not inline, so the inputs' size bounds them); Scatter's, every
  // position of the mask for each packed tensor.
  int64_t ResultBytes(int64_t active) const;
  // The response bytes besides its tensors that a mask of `batch_rows` rows
  // takes (Pack's per-row metadata), reserved out of the message limit.
  int64_t ReservedBytes(int64_t batch_rows) const;

  // The op's options over `base` (device and result places).
  PackOptions PackOptionsFor(
      const CallOptions& base,
      const std::optional<TensorView>& segment_ids) const;
  ScatterOptions ScatterOptionsFor(
      const CallOptions& base,
      const std::optional<TensorView>& segment_ids) const;
};

}  // namespace packd

#endif  // PACKD_SERVICE_CALL_SPEC_H_
