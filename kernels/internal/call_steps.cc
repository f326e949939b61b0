#include "kernels/internal/call_steps.h"

#include <string>
#include <utility>

#include "base/status_macros.h"
#include "kernels/device_staging.h"
#include "kernels/registry.h"

namespace packd::kernels_internal {
namespace {

// Checks dtype, dims, byte size, data pointer and device of one tensor;
// returns its byte size.
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

// Whether a call may gather before its sizes reach the host
// (CallOptions::fixed_place): a plain gather on a device whose every result
// has a place on that device, holding the source's B * S rows, that overlaps
// neither the mask, nor a source, nor another place.
bool GathersAhead(const CallOptions& options, const CallDevice& call,
                  const CallSources& sources, const TensorView& mask) {
  if (!sources.plain_gather || !options.outputs.empty() || !options.allocate ||
      !options.fixed_place || call.device.kind == DeviceKind::kCpu) {
    return false;
  }
  std::vector<ByteRange> taken = {RangeOf(mask)};
  for (const TensorView& x : sources.tensors) taken.push_back(RangeOf(x));
  for (size_t i = 0; i < sources.tensors.size(); ++i) {
    const FixedPlace fixed = options.fixed_place(i);
    const int64_t most = sources.tensors[i].nbytes();
    const ByteRange range{static_cast<const char*>(fixed.place.data), most};
    if (fixed.place.device != call.device || fixed.capacity < most ||
        (most > 0 && fixed.place.data == nullptr)) {
      return false;
    }
    for (const ByteRange& other : taken) {
      if (range.Overlaps(other)) return false;
    }
    taken.push_back(range);
  }
  return true;
}

}  // namespace

CallDevice CallDeviceOf(const CallOptions& options, const TensorView& mask) {
  return options.device.has_value() ? CallDevice{*options.device, true}
                                    : CallDevice{mask.device, false};
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

absl::Status ValidateIds(const TensorView& ids, absl::string_view field,
                         const TensorView& mask, const CallDevice& call) {
  switch (ids.dtype) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype is ", DTypeName(ids.dtype), "; ", field,
                       " must be uint8, int8, int16, int32 or int64"));
  }
  if (absl::MakeConstSpan(ids.shape) != absl::MakeConstSpan(mask.shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape ", ShapeString(ids.shape),
                     " must equal mask shape ", ShapeString(mask.shape)));
  }
  return ValidateTensor(ids, field, call).status();
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

absl::StatusOr<std::vector<ResultTensor>> RunSteps(
    const CallOptions& options, const CallDevice& call,
    const CallSources& sources_in, const TensorView& mask,
    const ShapesFn& result_shapes, const OpFn& op,
    std::unique_ptr<MaskPlan>* plan,
    const std::optional<TensorView>& segment_ids, DocumentCuts* documents) {
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

  if (GathersAhead(options, call, sources_in, mask)) {
    absl::StatusOr<std::unique_ptr<MaskPlan>> ahead =
        backend->ScanAhead(staged_mask, stream);
    if (!absl::IsUnimplemented(ahead.status())) {
      // Every result straight into its place, the device counting its rows;
      // the sizes reach the host with the one synchronisation.
      PACKD_RETURN_IF_ERROR(ahead.status());
      *plan = std::move(*ahead);
      std::vector<ResultTensor> results(sources.size());
      for (size_t i = 0; i < sources.size(); ++i) {
        const OutputPlace place = options.fixed_place(i).place;
        results[i].view.data = place.data;
        results[i].view.device = place.device;
        results[i].view.dtype = sources[i].dtype;
        PACKD_RETURN_IF_ERROR(
            backend->GatherCounted(**plan, staged[i], place.data, stream));
      }
      wait_on_exit.waited = true;
      PACKD_RETURN_IF_ERROR(runtime->Synchronize(stream));
      backend->FinishScan(plan->get());
      PACKD_ASSIGN_OR_RETURN(
          std::vector<Shape> shapes,
          result_shapes(Scanned{*backend, *runtime, **plan, staged, stream}));
      for (size_t i = 0; i < results.size(); ++i) {
        results[i].view.shape = shapes[i];
      }
      return results;
    }
  }
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
  // written, host results delivered, and the stream goes back to the runtime
  // idle.
  wait_on_exit.waited = true;
  PACKD_RETURN_IF_ERROR(runtime->Synchronize(stream));
  staging.Deliver();
  return results;
}

}  // namespace packd::kernels_internal
