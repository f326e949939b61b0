// Backend: one implementation of the pack and scatter ops for one kind of
// device, as the registry holds it. Pack() and Scatter() in kernels/pack.h
// validate every argument, place the tensors on the device, and then call a
// backend; backends trust their inputs.
//
//   PACKD_ASSIGN_OR_RETURN(auto plan, backend->Plan(mask, stream));
//   PACKD_RETURN_IF_ERROR(backend->Gather(*plan, x, out, stream));
#ifndef PACKD_KERNELS_BACKEND_H_
#define PACKD_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/layout_options.h"
#include "base/tensor_view.h"
#include "kernels/device_runtime.h"

namespace packd {

// What one scan of a [B, S] mask learns, on the host, plus whatever a backend
// keeps to gather and scatter with (subclasses). Computed once per request and
// reused for every tensor in it. One call's: read by its ops, not shared.
class MaskPlan {
 public:
  virtual ~MaskPlan() = default;

  int64_t batch = 0;                // B
  int64_t seq = 0;                  // S
  std::vector<int64_t> cu_seqlens;  // [B + 1]: 0, then running active counts
  // [B]: s of each row's last active position, -1 if none.
  std::vector<int64_t> last_index;

  int64_t total_active() const { return cu_seqlens.back(); }
  bool all_active() const { return total_active() == batch * seq; }
};

// Documents within rows (docs/design.md §8), in packed order: document d is
// packed rows cu[d] .. cu[d + 1] of row row[d], its last token at dense s
// last_index[d]. cu ends with total_active. Plain values of one call.
struct DocumentCuts {
  std::vector<int64_t> cu;
  std::vector<int64_t> row;
  std::vector<int64_t> last_index;
};

// One implementation of both ops, pack and scatter, for one kind of device
// ("span" and "torch" on cpu, "gpu" on cuda or hip). It works on memory of the
// device that the DeviceRuntime of its kind gives it, and queues its work on
// the call's stream. Safe to share across threads: every call of the process
// uses the one registered instance, each with its own plan and stream.
class Backend {
 public:
  virtual ~Backend() = default;

  // The implementation's name within its device kind ("span", "torch", "gpu").
  virtual absl::string_view name() const = 0;

  // Scans `mask` ([B, S], any dtype, nonzero is active: NaN is active, -0.0 is
  // not). Returns the plan, with cu_seqlens and last_index on the host, or
  // INTERNAL with the runtime's message if a device runtime fails.
  virtual absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(
      const TensorView& mask, const Stream& stream) = 0;

  // A scan whose sizes stay on the device until the stream's work is done,
  // so that a call whose results have places already needs no round trip:
  // the plan's cu_seqlens and last_index are filled by FinishScan, called
  // once the stream is synchronised, and GatherCounted gathers with it
  // meanwhile. UNIMPLEMENTED (the default) where the backend has none; the
  // call then scans with Plan.
  virtual absl::StatusOr<std::unique_ptr<MaskPlan>> ScanAhead(
      const TensorView& mask, const Stream& stream);
  virtual void FinishScan(MaskPlan* plan);
  // out = x[mask != 0] under a plan of ScanAhead: `out` holds x's B * S rows,
  // of which the first total_active are written.
  virtual absl::Status GatherCounted(const MaskPlan& plan, const TensorView& x,
                                     void* out, const Stream& stream);

  // out = x[mask != 0]: x is [B, S, *tail], out is [total_active, *tail] of the
  // same dtype, neither overlapping. Writes every byte of `out` (once the
  // stream's work is done). `out` depends on x's active positions only: a
  // host backend may read other positions (the span backend's branch-free
  // loop reads every position up to a piece's last active one) but no byte of
  // theirs reaches `out`, so the server leaves the positions after each row's
  // last active one ungathered, holding whatever bytes (server/
  // request_decoder.cc, RowExtents).
  virtual absl::Status Gather(const MaskPlan& plan, const TensorView& x,
                              const TensorView& out, const Stream& stream) = 0;

  // The inverse: dense[b, s] = packed[rank] at active positions, zeros
  // elsewhere. Writes every byte of `dense` (once the stream's work is done).
  virtual absl::Status Scatter(const MaskPlan& plan, const TensorView& packed,
                               const TensorView& dense,
                               const Stream& stream) = 0;

  // The flattened dense position (b * S + s) of every packed row, in host
  // memory: `positions` gets total_active entries.
  virtual absl::Status PackedPositions(const MaskPlan& plan,
                                       std::vector<int64_t>* positions,
                                       const Stream& stream) = 0;

  // Layouts (kernels/layout.h). out row j = x row rows[j] (an index into x's
  // flattened [B * S] positions), or where rows[j] is -1 the element `pad`
  // (ItemSize(x.dtype) bytes, host memory) repeated across the row. `rows`
  // is in host memory, out.shape[0] entries. Writes every byte of `out`.
  virtual absl::Status GatherRows(const TensorView& x,
                                  absl::Span<const int64_t> rows,
                                  const unsigned char* pad,
                                  const TensorView& out,
                                  const Stream& stream) = 0;

  // Layouts (Layout::source_runs, shifted_runs): out = the runs' rows in order,
  // each run's `count` packed tokens from `token` on taken from x ([B, S,
  // *tail], x[mask != 0] being the packed tokens), or `count` rows of the
  // element `pad` (host memory) for a token of -1. `runs` is in host memory
  // and covers out.shape[0] rows. UNIMPLEMENTED (the default) where the
  // backend has no faster way than by rows for this plan: the caller then
  // gathers the runs expanded, row by row.
  virtual absl::Status GatherRuns(const MaskPlan& plan, const TensorView& x,
                                  absl::Span<const TokenRun> runs,
                                  const unsigned char* pad,
                                  const TensorView& out, const Stream& stream);

  // The inverse: dense row rows[j] = packed row j where rows[j] >= 0 (rows
  // distinct and increasing), every other row of `dense` ([B, S, *tail])
  // zero.
  virtual absl::Status ScatterRows(const TensorView& packed,
                                   absl::Span<const int64_t> rows,
                                   const TensorView& dense,
                                   const Stream& stream) = 0;

  // Cuts the active tokens of each row into documents where `segment_ids`
  // ([B, S], an integer dtype, on the plan's device) changes between
  // consecutive active tokens; every row starts one. The default gathers the
  // ids with the plan into memory of `runtime` (the call's, which drives the
  // stream's device) and cuts on the host (any device); a backend that can
  // read the mask's plan on the host does it in one pass instead.
  virtual absl::Status Documents(const MaskPlan& plan,
                                 const TensorView& segment_ids,
                                 DeviceRuntime& runtime, DocumentCuts* out,
                                 const Stream& stream);
};

// The packed tokens of `ids` ([B, S], an integer dtype, on the plan's device)
// as int64 on the host: gathered with the plan into memory of `runtime` and
// copied back (any device).
absl::StatusOr<std::vector<int64_t>> GatherInts(Backend& backend,
                                                const MaskPlan& plan,
                                                const TensorView& ids,
                                                DeviceRuntime& runtime,
                                                const Stream& stream);

// The documents of a row-major run of packed tokens given their segment ids
// (as int64) and dense positions: the host half of Backend::Documents.
void CutDocuments(const MaskPlan& plan, const std::vector<int64_t>& ids,
                  const std::vector<int64_t>& positions, DocumentCuts* out);

}  // namespace packd

#endif  // PACKD_KERNELS_BACKEND_H_
