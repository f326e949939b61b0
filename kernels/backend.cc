#include "kernels/backend.h"

#include <utility>

#include "base/status_macros.h"

namespace packd {

void CutDocuments(const MaskPlan& plan, const std::vector<int64_t>& ids,
                  const std::vector<int64_t>& positions, DocumentCuts* out) {
  const int64_t total = plan.total_active();
  for (size_t b = 0; b + 1 < plan.cu_seqlens.size(); ++b) {
    for (int64_t k = plan.cu_seqlens[b]; k < plan.cu_seqlens[b + 1]; ++k) {
      if (k == plan.cu_seqlens[b] || ids[k] != ids[k - 1]) {
        if (!out->cu.empty()) {
          out->last_index.push_back(positions[k - 1] % plan.seq);
        }
        out->cu.push_back(k);
        out->row.push_back(static_cast<int64_t>(b));
      }
    }
  }
  if (!out->cu.empty()) {
    out->last_index.push_back(positions[total - 1] % plan.seq);
  }
  out->cu.push_back(total);
}

absl::Status Backend::GatherRuns(const MaskPlan&, const TensorView&,
                                 absl::Span<const TokenRun>,
                                 const unsigned char*, const TensorView&,
                                 const Stream&) {
  return absl::UnimplementedError("this backend gathers layouts by rows");
}

absl::StatusOr<std::unique_ptr<MaskPlan>> Backend::ScanAhead(const TensorView&,
                                                             const Stream&) {
  return absl::UnimplementedError("this backend scans with Plan");
}

void Backend::FinishScan(MaskPlan*) {}

absl::Status Backend::GatherCounted(const MaskPlan&, const TensorView&, void*,
                                    const Stream&) {
  return absl::UnimplementedError("this backend gathers with Gather");
}

absl::StatusOr<std::vector<int64_t>> GatherInts(Backend& backend,
                                                const MaskPlan& plan,
                                                const TensorView& ids,
                                                DeviceRuntime& runtime,
                                                const Stream& stream) {
  const int64_t total = plan.total_active();
  const int64_t item = ItemSize(ids.dtype);
  PACKD_ASSIGN_OR_RETURN(Buffer packed,
                         runtime.Allocate(total * item, stream.device()));
  TensorView view;
  view.data = packed.data();
  view.dtype = ids.dtype;
  view.shape = {total};
  view.device = stream.device();
  PACKD_RETURN_IF_ERROR(backend.Gather(plan, ids, view, stream));
  std::vector<char> host(total * item);
  PACKD_RETURN_IF_ERROR(
      runtime.CopyToHost(host.data(), packed.data(), host.size(), stream));
  std::vector<int64_t> out(total);
  for (int64_t k = 0; k < total; ++k)
    out[k] = IntegerAt(host.data(), ids.dtype, k);
  return out;
}

absl::Status Backend::Documents(const MaskPlan& plan,
                                const TensorView& segment_ids,
                                DeviceRuntime& runtime, DocumentCuts* out,
                                const Stream& stream) {
  PACKD_ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                         GatherInts(*this, plan, segment_ids, runtime, stream));
  std::vector<int64_t> positions;
  PACKD_RETURN_IF_ERROR(PackedPositions(plan, &positions, stream));
  CutDocuments(plan, ids, positions, out);
  return absl::OkStatus();
}

}  // namespace packd
