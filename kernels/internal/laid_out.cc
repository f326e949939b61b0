#include "kernels/internal/laid_out.h"

#include <algorithm>

#include "base/status_macros.h"

namespace packd::kernels_internal {

absl::StatusOr<TensorView> LaidOut::PackedRows(DeviceRuntime& runtime,
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

TensorView LaidOut::Flat(TensorView view) {
  view.shape.erase(view.shape.begin());
  return view;
}

absl::StatusOr<TensorView> LaidOut::Packed(Backend& backend,
                                           DeviceRuntime& runtime,
                                           const MaskPlan& plan, size_t source,
                                           const TensorView& x,
                                           const Stream& stream) {
  for (const auto& [index, view] : packed) {
    if (index == source) return view;
  }
  PACKD_ASSIGN_OR_RETURN(TensorView view, PackedRows(runtime, plan, x, stream));
  PACKD_RETURN_IF_ERROR(backend.Gather(plan, x, Flat(view), stream));
  packed.push_back({source, view});
  return view;
}

absl::Status LaidOut::CheckSamePrompts(const Scanned& scanned,
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

absl::Status LaidOut::Gather(Backend& backend, DeviceRuntime& runtime,
                             const MaskPlan& plan, size_t source,
                             const TensorView& x, bool shift,
                             const unsigned char* pad, const TensorView& out,
                             const Stream& stream) {
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

absl::Status LaidOut::Scatter(Backend& backend, DeviceRuntime& runtime,
                              const MaskPlan& plan, const TensorView& p,
                              const std::vector<int64_t>& tokens,
                              const TensorView& dense, const Stream& stream) {
  TensorView rows_p = p;
  const std::vector<int64_t>* order = &tokens;
  std::vector<int64_t> sorted;
  if (!std::is_sorted(tokens.begin(), tokens.end())) {
    std::vector<int64_t> perm(tokens.size());
    for (size_t j = 0; j < perm.size(); ++j) perm[j] = static_cast<int64_t>(j);
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

absl::Status LaidOut::Place(Backend& backend, const MaskPlan& plan,
                            const Stream& stream) {
  if (placed) return absl::OkStatus();
  placed = true;
  layout.ExpandRuns();
  PACKD_RETURN_IF_ERROR(DenseOf(backend, plan, layout.source, &rows, stream));
  return DenseOf(backend, plan, layout.shifted_source, &shifted_rows, stream);
}

absl::Status LaidOut::DenseOf(Backend& backend, const MaskPlan& plan,
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

}  // namespace packd::kernels_internal
