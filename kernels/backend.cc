#include "kernels/backend.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/status_macros.h"
#include "kernels/thread_pool.h"

namespace packd {
namespace {

// The value of element k of an integer tensor's bytes, as int64.
int64_t IntAt(const char* data, DType dtype, int64_t k) {
  switch (dtype) {
    case DType::kUInt8:
      return reinterpret_cast<const uint8_t*>(data)[k];
    case DType::kInt8:
      return reinterpret_cast<const int8_t*>(data)[k];
    case DType::kInt16:
      return reinterpret_cast<const int16_t*>(data)[k];
    case DType::kInt32:
      return reinterpret_cast<const int32_t*>(data)[k];
    default:
      return reinterpret_cast<const int64_t*>(data)[k];
  }
}

// Bytes of one row of a [N, ...] or [B, S, ...] tensor: its tail's.
int64_t TailBytes(const TensorView& t, int lead) {
  int64_t bytes = ItemSize(t.dtype);
  for (size_t d = lead; d < t.shape.size(); ++d) bytes *= t.shape[d];
  return bytes;
}

// Into how many pieces `units` units holding `bytes` in all are split: about
// one per 4 MiB, at least one, at most the pool's threads and `units`.
int Pieces(int64_t units, int64_t bytes) {
  const int64_t n = std::min<int64_t>(ThreadPool::Global().num_threads(),
                                      std::max<int64_t>(1, bytes >> 22));
  return static_cast<int>(std::max<int64_t>(1, std::min(n, units)));
}

// `n` rows of `width` bytes at `dst`, each the element `pad` (`item` bytes)
// repeated.
void FillRows(char* dst, int64_t n, int64_t width, const unsigned char* pad,
              int64_t item) {
  const int64_t bytes = n * width;
  if (bytes == 0) return;
  if (std::all_of(pad, pad + item, [](unsigned char b) { return b == 0; })) {
    std::memset(dst, 0, bytes);
    return;
  }
  for (int64_t at = 0; at < std::min(bytes, item); ++at) dst[at] = pad[at];
  // Doubling copies of what is written: whole elements, as item divides it.
  for (int64_t done = std::min(bytes, item); done < bytes;) {
    const int64_t n_copy = std::min(done, bytes - done);
    std::memcpy(dst + done, dst, n_copy);
    done += n_copy;
  }
}

}  // namespace

absl::Status Backend::GatherRows(const TensorView& x,
                                 absl::Span<const int64_t> rows,
                                 const unsigned char* pad,
                                 const TensorView& out, const Stream&) {
  const int64_t width = TailBytes(x, 2);
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0 || width == 0) return absl::OkStatus();
  const char* src = static_cast<const char*>(x.data);
  char* dst = static_cast<char*>(out.data);
  const int64_t item = ItemSize(x.dtype);
  const int pieces = Pieces(n, n * width);
  ThreadPool::Global().ParallelFor(pieces, [&](int p) {
    const int64_t end = n * (p + 1) / pieces;
    for (int64_t j = n * p / pieces; j < end;) {
      int64_t k = j + 1;
      if (rows[j] < 0) {
        while (k < end && rows[k] < 0) ++k;
        FillRows(dst + j * width, k - j, width, pad, item);
      } else {
        while (k < end && rows[k] == rows[j] + (k - j)) ++k;
        std::memcpy(dst + j * width, src + rows[j] * width, (k - j) * width);
      }
      j = k;
    }
  });
  return absl::OkStatus();
}

absl::Status Backend::ScatterRows(const TensorView& packed,
                                  absl::Span<const int64_t> rows,
                                  const TensorView& dense, const Stream&) {
  const int64_t width = TailBytes(dense, 2);
  const int64_t positions = dense.shape[0] * dense.shape[1];
  if (positions == 0 || width == 0) return absl::OkStatus();
  const char* src = static_cast<const char*>(packed.data);
  char* dst = static_cast<char*>(dense.data);
  // Runs of packed rows that land on consecutive dense rows, in dense order;
  // the gaps between them are zeroed.
  struct Run {
    int64_t from, to, len;
  };
  std::vector<Run> runs;
  for (int64_t j = 0, n = static_cast<int64_t>(rows.size()); j < n;) {
    if (rows[j] < 0) {
      ++j;
      continue;
    }
    int64_t k = j + 1;
    while (k < n && rows[k] == rows[j] + (k - j)) ++k;
    runs.push_back({j, rows[j], k - j});
    j = k;
  }
  if (runs.empty()) {
    std::memset(dst, 0, positions * width);
    return absl::OkStatus();
  }
  // Each piece has at least one run; it zeroes from the end of the run before
  // its first up to its last run's end (the last piece: to the end).
  const int64_t count = static_cast<int64_t>(runs.size());
  const int pieces = Pieces(count, positions * width);
  auto run_end = [&](int64_t r) { return runs[r].to + runs[r].len; };
  ThreadPool::Global().ParallelFor(pieces, [&](int p) {
    const int64_t r_begin = count * p / pieces;
    const int64_t r_end = count * (p + 1) / pieces;
    int64_t pos = r_begin == 0 ? 0 : run_end(r_begin - 1);
    for (int64_t r = r_begin; r < r_end; ++r) {
      std::memset(dst + pos * width, 0, (runs[r].to - pos) * width);
      std::memcpy(dst + runs[r].to * width, src + runs[r].from * width,
                  runs[r].len * width);
      pos = run_end(r);
    }
    if (p + 1 == pieces) {
      std::memset(dst + pos * width, 0, (positions - pos) * width);
    }
  });
  return absl::OkStatus();
}

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

absl::Status Backend::Documents(const MaskPlan& plan,
                                const TensorView& segment_ids,
                                DeviceRuntime& runtime, DocumentCuts* out,
                                const Stream& stream) {
  const int64_t total = plan.total_active();
  const int64_t item = ItemSize(segment_ids.dtype);
  PACKD_ASSIGN_OR_RETURN(Buffer packed,
                         runtime.Allocate(total * item, stream.device()));
  TensorView view;
  view.data = packed.data();
  view.dtype = segment_ids.dtype;
  view.shape = {total};
  view.device = stream.device();
  PACKD_RETURN_IF_ERROR(Gather(plan, segment_ids, view, stream));
  std::vector<char> host(total * item);
  PACKD_RETURN_IF_ERROR(
      runtime.CopyToHost(host.data(), packed.data(), host.size(), stream));
  std::vector<int64_t> ids(total);
  for (int64_t k = 0; k < total; ++k) {
    ids[k] = IntAt(host.data(), segment_ids.dtype, k);
  }
  std::vector<int64_t> positions;
  PACKD_RETURN_IF_ERROR(PackedPositions(plan, &positions, stream));
  CutDocuments(plan, ids, positions, out);
  return absl::OkStatus();
}

}  // namespace packd
