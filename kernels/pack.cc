#include "kernels/pack.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/internal/call_steps.h"
#include "kernels/internal/laid_out.h"
#include "kernels/mrope.h"
#include "kernels/pack_sizes.h"
#include "kernels/shared_prefix.h"

namespace packd {
namespace {

using kernels_internal::CallDevice;
using kernels_internal::CallDeviceOf;
using kernels_internal::CallSources;
using kernels_internal::LaidOut;
using kernels_internal::RunSteps;
using kernels_internal::Scanned;
using kernels_internal::ValidateIds;
using kernels_internal::ValidatePackArgs;
using kernels_internal::ValidateScatterArgs;

// [rows, *x.shape[2:]]: a row-major result of `rows` rows of x's tail,
// checked for overflow.
absl::StatusOr<Shape> RowsShape(const TensorView& x, int64_t rows,
                                absl::string_view field) {
  Shape s = x.shape;
  s.erase(s.begin());
  s[0] = rows;
  PACKD_RETURN_IF_ERROR(ByteSize(x.dtype, s, field).status());
  return s;
}

// A Scatter takes only the layout fields that place rows.
absl::Status ValidateScatterLayout(const LayoutOptions& layout, size_t packed) {
  PACKD_RETURN_IF_ERROR(CheckScatterFields(layout));
  return ValidateLayout(layout, packed);
}

// The layout of a scanned call: a shared stream's, or the sequences'.
absl::StatusOr<Layout> LayoutOf(const MaskPlan& plan,
                                const DocumentCuts& documents,
                                bool with_documents,
                                const LayoutOptions& options,
                                bool with_position_ids) {
  if (options.shared_prefix.has_value()) {
    return MakeSharedLayout(plan.cu_seqlens, options, with_position_ids);
  }
  return MakeLayout(with_documents ? documents.cu : plan.cu_seqlens, options,
                    with_position_ids);
}

}  // namespace

absl::Status CheckStartsWithMask(const TensorView& x, const TensorView& mask,
                                 absl::string_view field,
                                 absl::string_view mask_field) {
  if (x.shape.size() >= 2 && x.shape[0] == mask.shape[0] &&
      x.shape[1] == mask.shape[1]) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".shape ", ShapeString(x.shape), " does not start with ",
      mask_field, " shape ", ShapeString(mask.shape)));
}

absl::StatusOr<PackResult> Pack(absl::Span<const TensorView> inputs,
                                const TensorView& mask,
                                const PackOptions& options) {
  const CallDevice call = CallDeviceOf(options, mask);
  PACKD_RETURN_IF_ERROR(ValidatePackArgs(inputs, mask, call));
  if (options.segment_ids.has_value()) {
    PACKD_RETURN_IF_ERROR(
        ValidateIds(*options.segment_ids, "segment_ids", mask, call));
  }
  if (options.mrope.has_value()) {
    PACKD_RETURN_IF_ERROR(ValidateMRope(*options.mrope, inputs.size()));
    const int32_t input = options.mrope->input;
    PACKD_RETURN_IF_ERROR(ValidateIds(
        inputs[input], absl::StrCat("inputs[", input, "] (mrope.input)"), mask,
        call));
  }
  const LayoutOptions& lo = options.layout;
  const bool laid_out = lo.any();
  // mrope's pad rows take the layout's position ids.
  const bool layout_positions =
      options.with_position_ids || options.mrope.has_value();
  // The pad value of each input and the fill of each shift, as their bytes.
  LayoutValues values;
  CallSources sources{inputs, {}};
  if (laid_out) {
    std::vector<DType> dtypes;
    for (const TensorView& x : inputs) dtypes.push_back(x.dtype);
    PACKD_ASSIGN_OR_RETURN(values, CheckLayout(lo, dtypes));
    PACKD_RETURN_IF_ERROR(ValidateSharedPrefix(lo, mask.shape[0], inputs.size(),
                                               options.segment_ids.has_value(),
                                               /*for_pack=*/true));
    for (size_t i = 0; i < inputs.size(); ++i) sources.of_result.push_back(i);
    for (const Shift& shift : lo.shifts) {
      sources.of_result.push_back(shift.input);
    }
  }
  sources.plain_gather = !laid_out && !options.segment_ids.has_value() &&
                         !options.mrope.has_value();
  DocumentCuts documents;
  LaidOut laid;
  std::vector<int64_t> mrope;  // [3 * total_active], packed order
  auto shapes =
      [&](const Scanned& scanned) -> absl::StatusOr<std::vector<Shape>> {
    const MaskPlan& plan = scanned.plan;
    // Shifted results have a row per output row, or per target of a shared
    // stream.
    int64_t rows = plan.total_active(), shifted_rows = rows;
    if (laid_out) {
      PACKD_ASSIGN_OR_RETURN(
          laid.layout,
          LayoutOf(plan, documents, options.segment_ids.has_value(), lo,
                   layout_positions));
      rows = laid.layout.rows();
      shifted_rows = laid.layout.shifted_rows();
      if (lo.shared_prefix.has_value()) {
        PACKD_RETURN_IF_ERROR(
            laid.CheckSamePrompts(scanned, *lo.shared_prefix));
      }
    }
    if (options.mrope.has_value()) {
      PACKD_ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                             GatherInts(scanned.backend, plan,
                                        scanned.staged[options.mrope->input],
                                        scanned.runtime, scanned.stream));
      PACKD_ASSIGN_OR_RETURN(
          mrope,
          MRopePositions(
              ids,
              options.segment_ids.has_value() ? documents.cu : plan.cu_seqlens,
              plan.cu_seqlens, *options.mrope));
    }
    std::vector<Shape> out;
    for (size_t i = 0; i < inputs.size(); ++i) {
      PACKD_ASSIGN_OR_RETURN(
          Shape s, RowsShape(inputs[i], rows, absl::StrCat("packed[", i, "]")));
      out.push_back(std::move(s));
    }
    for (size_t j = 0; j < lo.shifts.size() && laid_out; ++j) {
      PACKD_ASSIGN_OR_RETURN(Shape s,
                             RowsShape(inputs[lo.shifts[j].input], shifted_rows,
                                       absl::StrCat("shifted[", j, "]")));
      out.push_back(std::move(s));
    }
    return out;
  };
  auto gather = [&](Backend& backend, DeviceRuntime& runtime,
                    const MaskPlan& plan, size_t i, const TensorView& x,
                    const TensorView& out,
                    const Stream& stream) -> absl::Status {
    if (!laid_out) return backend.Gather(plan, x, out, stream);
    const bool shift = i >= inputs.size();
    const size_t source = shift ? lo.shifts[i - inputs.size()].input : i;
    return laid.Gather(
        backend, runtime, plan, source, x, shift,
        shift ? values.fills[i - inputs.size()].data() : values.pads[i].data(),
        out, stream);
  };
  std::unique_ptr<MaskPlan> plan;
  PackResult result;
  PACKD_ASSIGN_OR_RETURN(result.packed,
                         RunSteps(options, call, sources, mask, shapes, gather,
                                  &plan, options.segment_ids, &documents));
  if (result.packed.size() > inputs.size()) {
    result.shifted.assign(
        std::make_move_iterator(result.packed.begin() + inputs.size()),
        std::make_move_iterator(result.packed.end()));
    result.packed.resize(inputs.size());
  }

  const int64_t total = plan->total_active();
  // A shared stream's rows are fewer than the active positions.
  result.total_active =
      lo.shared_prefix.has_value() ? laid.layout.rows() : total;
  for (size_t b = 0; b + 1 < plan->cu_seqlens.size(); ++b) {
    result.max_seqlen = std::max(result.max_seqlen,
                                 plan->cu_seqlens[b + 1] - plan->cu_seqlens[b]);
  }
  const bool docs = options.segment_ids.has_value();
  if (docs) {
    result.doc_cu_seqlens = std::move(documents.cu);
    result.doc_row = std::move(documents.row);
    result.doc_last_index = std::move(documents.last_index);
    for (size_t d = 0; d + 1 < result.doc_cu_seqlens.size(); ++d) {
      result.doc_max_seqlen =
          std::max(result.doc_max_seqlen,
                   result.doc_cu_seqlens[d + 1] - result.doc_cu_seqlens[d]);
    }
  }
  if (options.with_position_ids && !laid_out) {
    // A packed token's rank among its row's active tokens (cumsum(mask != 0) -
    // 1 at that token), or among its document's with segment ids.
    const std::vector<int64_t>& starts =
        docs ? result.doc_cu_seqlens : plan->cu_seqlens;
    result.position_ids.resize(total);
    for (size_t b = 0; b + 1 < starts.size(); ++b) {
      for (int64_t k = starts[b]; k < starts[b + 1]; ++k) {
        result.position_ids[k] = k - starts[b];
      }
    }
  }
  if (!laid_out) {
    if (options.with_token_mask) result.token_mask.assign(total, '\1');
    result.mrope_position_ids = std::move(mrope);
  }
  result.cu_seqlens = std::move(plan->cu_seqlens);
  result.last_index = std::move(plan->last_index);
  if (laid_out) {
    // The sequences' prefix array and maximum, extended for `fixed`.
    Layout& layout = laid.layout;
    (docs ? result.doc_cu_seqlens : result.cu_seqlens) =
        std::move(layout.cu_seqlens);
    (docs ? result.doc_max_seqlen : result.max_seqlen) = layout.max_seqlen;
    result.cu_seqlens_padded = std::move(layout.cu_seqlens_padded);
    result.max_seqlen_padded = layout.max_seqlen_padded;
    if (options.with_token_mask) {
      result.token_mask = TokenMaskOf(layout.source_runs);
    }
    if (options.mrope.has_value()) {
      result.mrope_position_ids =
          LayOutMRope(mrope, layout.source_runs, layout.position_ids);
    }
    if (options.with_position_ids) {
      result.position_ids = std::move(layout.position_ids);
    }
    result.seq_idx = std::move(layout.seq_idx);
    result.shared = std::move(layout.shared);
  }
  return result;
}

absl::StatusOr<ScatterResult> Scatter(absl::Span<const TensorView> packed,
                                      const TensorView& mask,
                                      const ScatterOptions& options) {
  const CallDevice call = CallDeviceOf(options, mask);
  PACKD_RETURN_IF_ERROR(
      ValidateScatterArgs(packed, mask, options.tail_shape, call));
  if (options.segment_ids.has_value()) {
    PACKD_RETURN_IF_ERROR(
        ValidateIds(*options.segment_ids, "segment_ids", mask, call));
  }
  // Documents place rows only through a layout: without one, Scatter is the
  // plain one (the ids were validated, and are not read).
  const bool laid_out = options.layout.any();
  const std::optional<SharedPrefix>& shared = options.layout.shared_prefix;
  const bool targets = shared.has_value() && shared->targets;
  if (laid_out) {
    PACKD_RETURN_IF_ERROR(ValidateScatterLayout(options.layout, packed.size()));
    PACKD_RETURN_IF_ERROR(ValidateSharedPrefix(
        options.layout, mask.shape[0], packed.size(),
        options.segment_ids.has_value(), /*for_pack=*/false));
  }
  DocumentCuts documents;
  LaidOut laid;
  auto shapes =
      [&](const Scanned& scanned) -> absl::StatusOr<std::vector<Shape>> {
    const MaskPlan& plan = scanned.plan;
    int64_t rows = plan.total_active();
    std::string what = absl::StrCat("the mask has ", rows, " active positions");
    if (laid_out) {
      PACKD_ASSIGN_OR_RETURN(
          laid.layout,
          LayoutOf(plan, documents, options.segment_ids.has_value(),
                   options.layout, /*with_position_ids=*/false));
      rows = laid.layout.rows();
      what = absl::StrCat("the layout has ", rows, " rows");
      if (options.layout.cp_size > 1) {
        absl::StrAppend(&what, " on cp_rank ", options.layout.cp_rank);
      } else if (options.layout.sp_size > 1) {
        absl::StrAppend(&what, " on sp_rank ", options.layout.sp_rank);
      } else if (targets) {
        rows = laid.layout.shifted_rows();
        what = absl::StrCat("the shared stream has ", rows, " targets");
      } else if (shared.has_value()) {
        what = absl::StrCat("the shared stream has ", rows, " rows");
      }
    }
    std::vector<Shape> out;
    for (size_t i = 0; i < packed.size(); ++i) {
      const TensorView& p = packed[i];
      if (p.shape[0] != rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("packed[", i, "].shape ", ShapeString(p.shape),
                         " has ", p.shape[0], " rows but ", what));
      }
      Shape s = {mask.shape[0], mask.shape[1]};
      s.insert(s.end(), p.shape.begin() + 1, p.shape.end());
      PACKD_RETURN_IF_ERROR(
          ByteSize(p.dtype, s, absl::StrCat("dense[", i, "]")).status());
      out.push_back(std::move(s));
    }
    return out;
  };
  auto scatter = [&](Backend& backend, DeviceRuntime& runtime,
                     const MaskPlan& plan, size_t, const TensorView& p,
                     const TensorView& dense,
                     const Stream& stream) -> absl::Status {
    if (!laid_out) return backend.Scatter(plan, p, dense, stream);
    laid.layout.ExpandRuns();
    return laid.Scatter(
        backend, runtime, plan, p,
        targets ? laid.layout.shifted_source : laid.layout.source, dense,
        stream);
  };
  std::unique_ptr<MaskPlan> plan;
  ScatterResult result;
  PACKD_ASSIGN_OR_RETURN(
      result.dense,
      RunSteps(options, call, CallSources{packed, {}}, mask, shapes, scatter,
               &plan, laid_out ? options.segment_ids : std::nullopt,
               &documents));
  return result;
}

}  // namespace packd
