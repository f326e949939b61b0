#include "kernels/pack.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/device_staging.h"
#include "kernels/pack_sizes.h"
#include "kernels/registry.h"
#include "kernels/shared_prefix.h"

namespace packd {
namespace {

// The device a call runs on, and how a tensor may relate to it.
struct CallDevice {
  Device device;
  // Whether the caller chose it (CallOptions::device) or it is the mask's.
  bool explicit_device = false;

  // OK when a tensor on `where` can take part in the call: on the call's
  // device, or in host memory that a call on a GPU stages.
  absl::Status Admits(const Device& where, absl::string_view field) const {
    if (where == device) return absl::OkStatus();
    if (explicit_device && where.kind == DeviceKind::kCpu) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is on ", where.ToString(),
        explicit_device ? " but the call runs on " : " but the mask is on ",
        device.ToString()));
  }
};

// Checks dtype, dims, byte size, data pointer and device of one tensor; returns
// its byte size.
absl::StatusOr<int64_t> ValidateTensor(const TensorView& t,
                                       absl::string_view field,
                                       const CallDevice& call) {
  PACKD_ASSIGN_OR_RETURN(int64_t bytes, ByteSize(t.dtype, t.shape, field));
  if (bytes > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has no data for its ", bytes, " bytes"));
  }
  PACKD_RETURN_IF_ERROR(call.Admits(t.device, field));
  return bytes;
}

absl::Status ValidateMask(const TensorView& mask, const CallDevice& call) {
  if (mask.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask.shape ", ShapeString(mask.shape),
                     " must have rank 2 ([B, S]), not ", mask.shape.size()));
  }
  return ValidateTensor(mask, "mask", call).status();
}

absl::Status ValidatePackArgs(absl::Span<const TensorView> inputs,
                              const TensorView& mask, const CallDevice& call) {
  PACKD_RETURN_IF_ERROR(ValidateMask(mask, call));
  if (inputs.empty()) {
    return absl::InvalidArgumentError(
        "inputs is empty: give at least one [B, S, *tail] tensor");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string field = absl::StrCat("inputs[", i, "]");
    PACKD_RETURN_IF_ERROR(CheckStartsWithMask(inputs[i], mask, field));
    PACKD_RETURN_IF_ERROR(ValidateTensor(inputs[i], field, call).status());
  }
  return absl::OkStatus();
}

absl::Status ValidateSegmentIds(const TensorView& segment_ids,
                                const TensorView& mask,
                                const CallDevice& call) {
  switch (segment_ids.dtype) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_ids.dtype is ", DTypeName(segment_ids.dtype),
          "; segment ids must be uint8, int8, int16, int32 or int64"));
  }
  if (absl::MakeConstSpan(segment_ids.shape) !=
      absl::MakeConstSpan(mask.shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_ids.shape ", ShapeString(segment_ids.shape),
                     " must equal mask shape ", ShapeString(mask.shape)));
  }
  return ValidateTensor(segment_ids, "segment_ids", call).status();
}

absl::Status ValidateScatterArgs(absl::Span<const TensorView> packed,
                                 const TensorView& mask,
                                 const std::optional<Shape>& tail_shape,
                                 const CallDevice& call) {
  PACKD_RETURN_IF_ERROR(ValidateMask(mask, call));
  if (packed.empty()) {
    return absl::InvalidArgumentError(
        "packed is empty: give at least one [total_active, *tail] tensor");
  }
  for (size_t i = 0; i < packed.size(); ++i) {
    const std::string field = absl::StrCat("packed[", i, "]");
    const TensorView& p = packed[i];
    if (p.shape.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape [] must have rank 1 or more ([total_active, *tail])"));
    }
    PACKD_RETURN_IF_ERROR(ValidateTensor(p, field, call).status());
    if (tail_shape.has_value()) {
      const auto tail = absl::MakeConstSpan(p.shape).subspan(1);
      if (tail != absl::MakeConstSpan(*tail_shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tail_shape ", ShapeString(*tail_shape), " does not match ", field,
            ".shape[1:] ", ShapeString(tail)));
      }
    }
  }
  return absl::OkStatus();
}

struct ByteRange {
  const char* begin;
  int64_t size;
  bool Overlaps(const ByteRange& o) const {
    return size > 0 && o.size > 0 && begin < o.begin + o.size &&
           o.begin < begin + size;
  }
};

ByteRange RangeOf(const TensorView& t) {
  return ByteRange{static_cast<const char*>(t.data), t.nbytes()};
}

// INVALID_ARGUMENT when result i's memory overlaps the mask, a source or an
// earlier result: the kernels read sources while they write results.
absl::Status CheckNoOverlap(const std::vector<ResultTensor>& results, size_t i,
                            absl::Span<const TensorView> sources,
                            const TensorView& mask) {
  const std::string field = absl::StrCat("outputs[", i, "]");
  const ByteRange range = RangeOf(results[i].view);
  if (range.Overlaps(RangeOf(mask))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " overlaps the mask"));
  }
  for (size_t j = 0; j < sources.size(); ++j) {
    if (range.Overlaps(RangeOf(sources[j]))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " overlaps input ", j));
    }
  }
  for (size_t j = 0; j < i; ++j) {
    if (range.Overlaps(RangeOf(results[j].view))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " overlaps outputs[", j, "]"));
    }
  }
  return absl::OkStatus();
}

// The results' final places: the caller's outputs (checked against the
// expected shapes and dtypes: result i has like[i]'s), or where `allocate`
// says, or memory the call's runtime allocates. No result may overlap the
// mask or a source.
absl::StatusOr<std::vector<ResultTensor>> PlaceResults(
    const CallOptions& options, const CallDevice& call, DeviceRuntime& runtime,
    absl::Span<const TensorView> sources, const std::vector<TensorView>& like,
    const std::vector<Shape>& shapes, const TensorView& mask) {
  std::vector<ResultTensor> results(like.size());
  if (options.outputs.empty()) {
    for (size_t i = 0; i < like.size(); ++i) {
      TensorView& v = results[i].view;
      v.dtype = like[i].dtype;
      v.shape = shapes[i];
      v.device = call.device;
      PACKD_ASSIGN_OR_RETURN(
          int64_t bytes,
          ByteSize(v.dtype, v.shape, absl::StrCat("result[", i, "]")));
      if (options.allocate) {
        PACKD_ASSIGN_OR_RETURN(OutputPlace place, options.allocate(i, bytes));
        v.data = place.data;
        v.device = place.device;
        PACKD_RETURN_IF_ERROR(
            call.Admits(v.device, absl::StrCat("outputs[", i, "]")));
        PACKD_RETURN_IF_ERROR(CheckNoOverlap(results, i, sources, mask));
      } else {
        PACKD_ASSIGN_OR_RETURN(results[i].storage,
                               runtime.Allocate(bytes, call.device));
        v.data = results[i].storage.data();
      }
    }
    return results;
  }
  if (options.outputs.size() != like.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "outputs has ", options.outputs.size(), " entries but there are ",
        like.size() == sources.size()
            ? absl::StrCat(sources.size(), " inputs: give one per input")
            : absl::StrCat(like.size(),
                           " results: give one per input, then one per shift"),
        ", or none"));
  }
  for (size_t i = 0; i < like.size(); ++i) {
    const std::string field = absl::StrCat("outputs[", i, "]");
    const TensorView& out = options.outputs[i];
    if (out.dtype != like[i].dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype is ", DTypeName(out.dtype),
                       " but the result is ", DTypeName(like[i].dtype)));
    }
    if (absl::MakeConstSpan(out.shape) != absl::MakeConstSpan(shapes[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape is ", ShapeString(out.shape),
                       " but the result is ", ShapeString(shapes[i])));
    }
    PACKD_RETURN_IF_ERROR(ValidateTensor(out, field, call).status());
    results[i].view = out;
    PACKD_RETURN_IF_ERROR(CheckNoOverlap(results, i, sources, mask));
  }
  return results;
}

// What a call knows once its mask is scanned: its backend and runtime, the
// plan, its sources on the device, its stream.
struct Scanned {
  Backend& backend;
  DeviceRuntime& runtime;
  const MaskPlan& plan;
  absl::Span<const TensorView> staged;
  const Stream& stream;
};
// The result shapes of an op, known once the mask is scanned; an error when
// the sources do not fit the mask (or the layout refuses them). Nothing of
// the results exists yet.
using ShapesFn =
    std::function<absl::StatusOr<std::vector<Shape>>(const Scanned& scanned)>;
// Runs the op for result `index` from `source`, writing `out`, with memory of
// `runtime` for whatever else it needs.
using OpFn = std::function<absl::Status(
    Backend& backend, DeviceRuntime& runtime, const MaskPlan& plan,
    size_t index, const TensorView& source, const TensorView& out,
    const Stream& stream)>;

// What a call computes: its sources, and for each result the source it is
// made from (empty: one result per source).
struct CallSources {
  absl::Span<const TensorView> tensors;
  std::vector<size_t> of_result;
};

// The steps of every Pack and Scatter, in order, after validation: find the
// implementation and runtime, stage host tensors to the device, scan the mask
// once (and cut the documents), place the results, run the op for every
// result, copy host-bound results back, and wait for the device. Returns the
// results and the plan.
absl::StatusOr<std::vector<ResultTensor>> RunCall(
    const CallOptions& options, const CallDevice& call,
    const CallSources& sources_in, const TensorView& mask,
    const ShapesFn& result_shapes, const OpFn& op,
    std::unique_ptr<MaskPlan>* plan,
    const std::optional<TensorView>& segment_ids = std::nullopt,
    DocumentCuts* documents = nullptr) {
  const absl::Span<const TensorView> sources = sources_in.tensors;
  std::vector<size_t> of_result = sources_in.of_result;
  if (of_result.empty()) {
    for (size_t i = 0; i < sources.size(); ++i) of_result.push_back(i);
  }
  // One device check per call (a GPU runtime asks the driver).
  PACKD_ASSIGN_OR_RETURN(
      const Registry::ForCall found,
      Registry::Global().FindForCall(call.device, options.impl));
  DeviceRuntime* const runtime = found.runtime;
  Backend* const backend = found.backend;
  PACKD_ASSIGN_OR_RETURN(Stream stream, runtime->AcquireStream(call.device));
  DeviceStaging staging(runtime, &stream);
  // However the call ends, the device is done with it before the staging
  // buffers (released after this guard) and the caller's regions are let go.
  struct WaitOnExit {
    DeviceRuntime* runtime;
    const Stream* stream;
    bool waited = false;
    ~WaitOnExit() {
      if (!waited) (void)runtime->Synchronize(*stream);
    }
  } wait_on_exit{runtime, &stream};

  TensorView staged_mask = mask;
  PACKD_RETURN_IF_ERROR(staging.Upload(&staged_mask));
  std::vector<TensorView> staged(sources.begin(), sources.end());
  for (TensorView& t : staged) PACKD_RETURN_IF_ERROR(staging.Upload(&t));

  PACKD_ASSIGN_OR_RETURN(*plan, backend->Plan(staged_mask, stream));
  if (segment_ids.has_value()) {
    TensorView ids = *segment_ids;
    PACKD_RETURN_IF_ERROR(staging.Upload(&ids));
    PACKD_RETURN_IF_ERROR(
        backend->Documents(**plan, ids, *runtime, documents, stream));
  }
  PACKD_ASSIGN_OR_RETURN(
      std::vector<Shape> shapes,
      result_shapes(Scanned{*backend, *runtime, **plan, staged, stream}));
  std::vector<TensorView> like;
  for (size_t source : of_result) like.push_back(sources[source]);
  PACKD_ASSIGN_OR_RETURN(
      std::vector<ResultTensor> results,
      PlaceResults(options, call, *runtime, sources, like, shapes, mask));
  for (size_t i = 0; i < results.size(); ++i) {
    TensorView out = results[i].view;
    PACKD_ASSIGN_OR_RETURN(out.data,
                           staging.Result(out.data, out.device, out.nbytes()));
    out.device = call.device;
    PACKD_RETURN_IF_ERROR(
        op(*backend, *runtime, **plan, i, staged[of_result[i]], out, stream));
  }
  PACKD_RETURN_IF_ERROR(staging.Download());
  // The call's work is complete when it returns: results on the device are
  // written, and the stream goes back to the runtime idle.
  wait_on_exit.waited = true;
  PACKD_RETURN_IF_ERROR(runtime->Synchronize(stream));
  return results;
}

CallDevice CallDeviceOf(const CallOptions& options, const TensorView& mask) {
  return options.device.has_value() ? CallDevice{*options.device, true}
                                    : CallDevice{mask.device, false};
}

// A call with a layout, once its mask is scanned: the layout, and for each
// output row the dense position it is gathered from (-1: padding or fill).
struct LaidOut {
  // Rows narrower than this go through the packed rows (one plain gather,
  // then copies of whole sequences, which are runs of packed rows); wider ones
  // are copied straight from the dense tensor by dense position.
  static constexpr int64_t kNarrowRow = 64;

  Layout layout;
  std::vector<int64_t> rows;          // of layout.source
  std::vector<int64_t> shifted_rows;  // of layout.shifted_source
  bool placed = false;                // rows computed
  // The packed rows of each narrow source, by its index among the call's
  // sources (never by its address: two empty inputs, or one memory viewed
  // as two dtypes, share one), as [1, N, *tail].
  std::vector<std::pair<size_t, TensorView>> packed;
  std::vector<Buffer> held;

  // Memory for the N packed rows of a tensor like `like` ([B, S, *tail]),
  // held until the call ends, viewed as [1, N, *tail]: the shape GatherRows
  // and ScatterRows take, whose rows are packed token indices.
  absl::StatusOr<TensorView> PackedRows(DeviceRuntime& runtime,
                                        const MaskPlan& plan,
                                        const TensorView& like,
                                        const Stream& stream) {
    const int64_t n = plan.total_active();
    PACKD_ASSIGN_OR_RETURN(
        Buffer buffer,
        runtime.Allocate(n * PositionBytes(like), stream.device()));
    TensorView view = like;
    view.data = buffer.data();
    view.device = stream.device();
    view.shape[0] = 1;
    view.shape[1] = n;
    held.push_back(std::move(buffer));
    return view;
  }

  // The same view as [N, *tail], the packed tensor Gather and Scatter take.
  static TensorView Flat(TensorView view) {
    view.shape.erase(view.shape.begin());
    return view;
  }

  // The packed rows of `x`, source `source` of the call, gathered once per
  // source (a shift reuses its input's).
  absl::StatusOr<TensorView> Packed(Backend& backend, DeviceRuntime& runtime,
                                    const MaskPlan& plan, size_t source,
                                    const TensorView& x, const Stream& stream) {
    for (const auto& [index, view] : packed) {
      if (index == source) return view;
    }
    PACKD_ASSIGN_OR_RETURN(TensorView view,
                           PackedRows(runtime, plan, x, stream));
    PACKD_RETURN_IF_ERROR(backend.Gather(plan, x, Flat(view), stream));
    packed.push_back({source, view});
    return view;
  }

  // INVALID_ARGUMENT when a member's prompt differs from its group's first
  // row's in one of `shared`'s same_inputs, compared on the host: the
  // prompts of the groups of two or more rows gathered by runs where the
  // backend can, else the input's packed rows (made on the device, and kept
  // for its gather).
  absl::Status CheckSamePrompts(const Scanned& scanned,
                                const SharedPrefix& shared) {
    const std::vector<int64_t>& cu = scanned.plan.cu_seqlens;
    for (int32_t i : shared.same_inputs) {
      const TensorView& x = scanned.staged[i];
      const int64_t width = PositionBytes(x);
      if (scanned.runtime.kind() == DeviceKind::kCpu) {
        const ElementBytes zero{};
        absl::Status by_runs = ::packd::CheckSamePromptsBy(
            shared, cu, i, width,
            [&](absl::Span<const TokenRun> runs, unsigned char* out) {
              TensorView rows = Flat(x);  // [rows, *tail] at `out`
              rows.shape[0] = 0;
              for (const TokenRun& run : runs) rows.shape[0] += run.count;
              rows.data = out;
              return scanned.backend.GatherRuns(
                  scanned.plan, x, runs, zero.data(), rows, scanned.stream);
            });
        if (!absl::IsUnimplemented(by_runs)) {
          PACKD_RETURN_IF_ERROR(by_runs);
          continue;
        }
      }
      PACKD_ASSIGN_OR_RETURN(TensorView rows_view,
                             Packed(scanned.backend, scanned.runtime,
                                    scanned.plan, i, x, scanned.stream));
      std::vector<unsigned char> host(rows_view.nbytes());
      if (!host.empty()) {
        PACKD_RETURN_IF_ERROR(scanned.runtime.CopyToHost(
            host.data(), rows_view.data, rows_view.nbytes(), scanned.stream));
      }
      PACKD_RETURN_IF_ERROR(
          ::packd::CheckSamePrompts(shared, cu, i, host.data(), width));
    }
    return absl::OkStatus();
  }

  // Result rows of x, source `source` of the call, by the layout (`shift`: its
  // shifted rows), `pad` where there is no token.
  absl::Status Gather(Backend& backend, DeviceRuntime& runtime,
                      const MaskPlan& plan, size_t source, const TensorView& x,
                      bool shift, const unsigned char* pad,
                      const TensorView& out, const Stream& stream) {
    // By runs where the backend can, else by rows.
    absl::Status by_runs = backend.GatherRuns(
        plan, x, shift ? layout.shifted_runs : layout.source_runs, pad, out,
        stream);
    if (!absl::IsUnimplemented(by_runs)) return by_runs;
    layout.ExpandRuns();
    if (PositionBytes(x) < kNarrowRow) {
      PACKD_ASSIGN_OR_RETURN(TensorView rows_view,
                             Packed(backend, runtime, plan, source, x, stream));
      return backend.GatherRows(rows_view,
                                shift ? layout.shifted_source : layout.source,
                                pad, out, stream);
    }
    PACKD_RETURN_IF_ERROR(Place(backend, plan, stream));
    return backend.GatherRows(x, shift ? shifted_rows : rows, pad, out, stream);
  }

  // The dense tensor of a Scatter of `p`, whose row j holds packed token
  // tokens[j] (the layout's source, or a shared stream's targets): every
  // other position zero. ScatterRows takes increasing rows: a shared stream's
  // (its groups' members interleave) are put in order first.
  absl::Status Scatter(Backend& backend, DeviceRuntime& runtime,
                       const MaskPlan& plan, const TensorView& p,
                       const std::vector<int64_t>& tokens,
                       const TensorView& dense, const Stream& stream) {
    TensorView rows_p = p;
    const std::vector<int64_t>* order = &tokens;
    std::vector<int64_t> sorted;
    if (!std::is_sorted(tokens.begin(), tokens.end())) {
      std::vector<int64_t> perm(tokens.size());
      for (size_t j = 0; j < perm.size(); ++j)
        perm[j] = static_cast<int64_t>(j);
      std::sort(perm.begin(), perm.end(),
                [&](int64_t a, int64_t b) { return tokens[a] < tokens[b]; });
      for (int64_t j : perm) sorted.push_back(tokens[j]);
      TensorView as_rows = p;  // [1, N, *tail]: GatherRows' x
      as_rows.shape.insert(as_rows.shape.begin(), 1);
      PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                             runtime.Allocate(p.nbytes(), stream.device()));
      rows_p.data = buffer.data();
      rows_p.device = stream.device();
      held.push_back(std::move(buffer));
      const ElementBytes zero{};
      PACKD_RETURN_IF_ERROR(
          backend.GatherRows(as_rows, perm, zero.data(), rows_p, stream));
      order = &sorted;
    }
    if (PositionBytes(dense) < kNarrowRow) {
      // The packed rows of every real token (zero for other ranks'), then
      // the plain Scatter.
      PACKD_ASSIGN_OR_RETURN(TensorView view,
                             PackedRows(runtime, plan, dense, stream));
      PACKD_RETURN_IF_ERROR(backend.ScatterRows(rows_p, *order, view, stream));
      return backend.Scatter(plan, Flat(view), dense, stream);
    }
    std::vector<int64_t> rows;
    PACKD_RETURN_IF_ERROR(DenseOf(backend, plan, *order, &rows, stream));
    return backend.ScatterRows(rows_p, rows, dense, stream);
  }

  // Computes the dense rows of the layout's source and shifted rows once.
  absl::Status Place(Backend& backend, const MaskPlan& plan,
                     const Stream& stream) {
    if (placed) return absl::OkStatus();
    placed = true;
    layout.ExpandRuns();
    PACKD_RETURN_IF_ERROR(DenseOf(backend, plan, layout.source, &rows, stream));
    return DenseOf(backend, plan, layout.shifted_source, &shifted_rows, stream);
  }

  // The dense position of each packed token of `tokens` (-1 stays -1), with
  // the backend's packed positions (found once).
  absl::Status DenseOf(Backend& backend, const MaskPlan& plan,
                       const std::vector<int64_t>& tokens,
                       std::vector<int64_t>* out, const Stream& stream) {
    if (positions.empty() && plan.total_active() > 0) {
      PACKD_RETURN_IF_ERROR(backend.PackedPositions(plan, &positions, stream));
    }
    out->resize(tokens.size());
    for (size_t j = 0; j < tokens.size(); ++j) {
      (*out)[j] = tokens[j] < 0 ? -1 : positions[tokens[j]];
    }
    return absl::OkStatus();
  }

  std::vector<int64_t> positions;  // packed token -> dense position
};

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
    PACKD_RETURN_IF_ERROR(ValidateSegmentIds(*options.segment_ids, mask, call));
  }
  const LayoutOptions& lo = options.layout;
  const bool laid_out = lo.any();
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
  DocumentCuts documents;
  LaidOut laid;
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
                   options.with_position_ids));
      rows = laid.layout.rows();
      shifted_rows = laid.layout.shifted_rows();
      if (lo.shared_prefix.has_value()) {
        PACKD_RETURN_IF_ERROR(
            laid.CheckSamePrompts(scanned, *lo.shared_prefix));
      }
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
                         RunCall(options, call, sources, mask, shapes, gather,
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
    PACKD_RETURN_IF_ERROR(ValidateSegmentIds(*options.segment_ids, mask, call));
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
      RunCall(options, call, CallSources{packed, {}}, mask, shapes, scatter,
              &plan, laid_out ? options.segment_ids : std::nullopt,
              &documents));
  return result;
}

}  // namespace packd
