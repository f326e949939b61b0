// The steps every Pack and Scatter of the op library takes (kernels/pack.cc),
// apart from what the two ops compute: the call's device, the checks of its
// tensors, where its results go, and RunSteps, which finds the backend, stages
// host tensors, scans the mask once and runs an op for every result. Not API:
// pack.h is.
//
//   const CallDevice call = CallDeviceOf(options, mask);
//   PACKD_RETURN_IF_ERROR(ValidatePackArgs(inputs, mask, call));
//   PACKD_ASSIGN_OR_RETURN(auto results, RunSteps(options, call, sources, mask,
//                                                shapes, op, &plan));
#ifndef PACKD_KERNELS_INTERNAL_CALL_STEPS_H_
#define PACKD_KERNELS_INTERNAL_CALL_STEPS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/tensor_view.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/pack.h"

namespace packd::kernels_internal {

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

// The call's device: CallOptions::device when given, else the mask's.
CallDevice CallDeviceOf(const CallOptions& options, const TensorView& mask);

// INVALID_ARGUMENT unless there are inputs, each [B, S, *tail] over the mask.
absl::Status ValidatePackArgs(absl::Span<const TensorView> inputs,
                              const TensorView& mask, const CallDevice& call);

// INVALID_ARGUMENT naming `field` unless `ids` (segment ids, token ids) is an
// integer [B, S] tensor.
absl::Status ValidateIds(const TensorView& ids, absl::string_view field,
                         const TensorView& mask, const CallDevice& call);

// INVALID_ARGUMENT unless there are packed tensors of rank 1 or more, whose
// tail is tail_shape when given.
absl::Status ValidateScatterArgs(absl::Span<const TensorView> packed,
                                 const TensorView& mask,
                                 const std::optional<Shape>& tail_shape,
                                 const CallDevice& call);

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
  // The op is Backend::Gather of each source and nothing else (a Pack
  // without layout, documents or mrope): with CallOptions::fixed_place it
  // may gather before the sizes reach the host.
  bool plain_gather = false;
};

// The steps of every Pack and Scatter, in order, after validation: find the
// implementation and runtime, stage host tensors to the device, scan the mask
// once (and cut the documents), place the results, run the op for every
// result, copy host-bound results back, and wait for the device. Returns the
// results and the plan.
absl::StatusOr<std::vector<ResultTensor>> RunSteps(
    const CallOptions& options, const CallDevice& call,
    const CallSources& sources_in, const TensorView& mask,
    const ShapesFn& result_shapes, const OpFn& op,
    std::unique_ptr<MaskPlan>* plan,
    const std::optional<TensorView>& segment_ids = std::nullopt,
    DocumentCuts* documents = nullptr);

}  // namespace packd::kernels_internal

#endif  // PACKD_KERNELS_INTERNAL_CALL_STEPS_H_
