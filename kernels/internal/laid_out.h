// A Pack or Scatter with a layout (kernels/layout.h), once its mask is
// scanned: the rows of each result by the layout, gathered by runs where the
// backend can, else through the packed rows (narrow rows) or by dense position
// (wide ones); the dense tensor of a Scatter of laid-out rows; the shared
// prompts' equality check. Not API: pack.h is.
//
//   LaidOut laid;
//   PACKD_ASSIGN_OR_RETURN(laid.layout, MakeLayout(plan.cu_seqlens, options));
//   PACKD_RETURN_IF_ERROR(laid.Gather(backend, runtime, plan, i, x,
//                                     /*shift=*/false, pad, out, stream));
#ifndef PACKD_KERNELS_INTERNAL_LAID_OUT_H_
#define PACKD_KERNELS_INTERNAL_LAID_OUT_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/buffer.h"
#include "base/tensor_view.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/internal/call_steps.h"
#include "kernels/layout.h"
#include "kernels/pack_sizes.h"
#include "kernels/shared_prefix.h"

namespace packd::kernels_internal {

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
  std::vector<int64_t> positions;  // packed token -> dense position, found once
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
                                        const Stream& stream);

  // The same view as [N, *tail], the packed tensor Gather and Scatter take.
  static TensorView Flat(TensorView view);

  // The packed rows of `x`, source `source` of the call, gathered once per
  // source (a shift reuses its input's).
  absl::StatusOr<TensorView> Packed(Backend& backend, DeviceRuntime& runtime,
                                    const MaskPlan& plan, size_t source,
                                    const TensorView& x, const Stream& stream);

  // INVALID_ARGUMENT when a member's prompt differs from its group's first
  // row's in one of `shared`'s same_inputs, compared on the host: the
  // prompts of the groups of two or more rows gathered by runs where the
  // backend can, else the input's packed rows (made on the device, and kept
  // for its gather).
  absl::Status CheckSamePrompts(const Scanned& scanned,
                                const SharedPrefix& shared);

  // Result rows of x, source `source` of the call, by the layout (`shift`: its
  // shifted rows), `pad` where there is no token.
  absl::Status Gather(Backend& backend, DeviceRuntime& runtime,
                      const MaskPlan& plan, size_t source, const TensorView& x,
                      bool shift, const unsigned char* pad,
                      const TensorView& out, const Stream& stream);

  // The dense tensor of a Scatter of `p`, whose row j holds packed token
  // tokens[j] (the layout's source, or a shared stream's targets): every
  // other position zero. ScatterRows takes increasing rows: a shared stream's
  // (its groups' members interleave) are put in order first.
  absl::Status Scatter(Backend& backend, DeviceRuntime& runtime,
                       const MaskPlan& plan, const TensorView& p,
                       const std::vector<int64_t>& tokens,
                       const TensorView& dense, const Stream& stream);

  // Computes the dense rows of the layout's source and shifted rows once.
  absl::Status Place(Backend& backend, const MaskPlan& plan,
                     const Stream& stream);

  // The dense position of each packed token of `tokens` (-1 stays -1), with
  // the backend's packed positions (found once).
  absl::Status DenseOf(Backend& backend, const MaskPlan& plan,
                       const std::vector<int64_t>& tokens,
                       std::vector<int64_t>* out, const Stream& stream);
};

}  // namespace packd::kernels_internal

#endif  // PACKD_KERNELS_INTERNAL_LAID_OUT_H_
