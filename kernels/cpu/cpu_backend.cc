#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "base/buffer.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_plan.h"
#include "kernels/cpu/mask_scan.h"
#include "kernels/registry.h"
#include "kernels/thread_pool.h"

namespace packd {
namespace {

using cpu_internal::CpuPlan;
using cpu_internal::CutDocumentsOf;
using cpu_internal::kOnes;
using cpu_internal::Load64;
using cpu_internal::Run;
using cpu_internal::ScanMaskPlan;

// Below this many bytes per thread, waking another thread costs more than it
// saves.
constexpr int64_t kMinBytesPerPiece = int64_t{1} << 20;
// Runs shorter than this on average are better compacted element by element
// (narrow rows only).
constexpr int64_t kMinRunBytesForMemcpy = 256;

// The number of pieces to split `bytes` of work into.
int Pieces(int64_t bytes) {
  const int64_t by_size = std::max<int64_t>(1, bytes / kMinBytesPerPiece);
  return static_cast<int>(
      std::min<int64_t>(ThreadPool::Global().num_threads(), by_size));
}

// Position range [begin, end) of piece i of n over [0, total).
std::pair<int64_t, int64_t> PieceRange(int64_t total, int i, int n) {
  return {total * i / n, total * (i + 1) / n};
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

int64_t RowBytes(const MaskPlan& plan, const TensorView& dense) {
  const int64_t positions = plan.batch * plan.seq;
  return positions == 0 ? 0 : dense.nbytes() / positions;
}

// Packed row index of dense position p: active positions before p.
int64_t ActiveBefore(const CpuPlan& plan, int64_t p) {
  if (plan.seq == 0) return 0;
  const int64_t b = p / plan.seq;
  const uint8_t* a = plan.active.data();
  int64_t k = plan.cu_seqlens[b];
  for (int64_t q = b * plan.seq; q < p; ++q) k += a[q];
  return k;
}

// Last active position in [begin, end), or begin - 1 if none.
int64_t LastActive(const CpuPlan& plan, int64_t begin, int64_t end) {
  int64_t p = end - 1;
  while (p >= begin && plan.active[p] == 0) --p;
  return p;
}

struct U128 {
  uint64_t lo, hi;
};

template <typename T>
T ZeroUnless(T v, uint8_t a) {
  const T keep = static_cast<T>(0) - static_cast<T>(a);
  return v & keep;
}
template <>
U128 ZeroUnless(U128 v, uint8_t a) {
  return U128{ZeroUnless(v.lo, a), ZeroUnless(v.hi, a)};
}

// Pack of dense positions [begin, end) for rows of sizeof(T) bytes, up to the
// last active one (CompactFlags: compress stores, or every position written at
// the next free packed row, which only an active one claims), so each write
// lands inside this piece's packed range.
template <typename T>
void CompactPiece(const CpuPlan& plan, const char* src, char* dst,
                  int64_t begin, int64_t end) {
  const int64_t last = LastActive(plan, begin, end);
  if (last < begin) return;
  // Other pieces write the packed rows after this one's, at once: room for
  // this piece's own rows only.
  const int64_t first = ActiveBefore(plan, begin);
  CompactFlags(plan.active.data() + begin, src + begin * sizeof(T),
               last + 1 - begin, sizeof(T), dst + first * sizeof(T),
               ActiveBefore(plan, last + 1) - first);
}

// Scatter of dense positions [begin, end) for rows of sizeof(T) bytes,
// branch-free: each position takes the next packed row, or zero. Reads stay
// inside the piece's packed range for the same reason as CompactPiece; the tail
// after the last active position is zero-filled.
template <typename T>
void ExpandPiece(const CpuPlan& plan, const char* src, char* dst, int64_t begin,
                 int64_t end) {
  const int64_t last = LastActive(plan, begin, end);
  const uint8_t* a = plan.active.data();
  if (last >= begin) {
    const char* in = src + ActiveBefore(plan, begin) * sizeof(T);
    int64_t k = 0;
    for (int64_t p = begin; p <= last; ++p) {
      T v;
      std::memcpy(&v, in + k * sizeof(T), sizeof(T));
      v = ZeroUnless(v, a[p]);
      std::memcpy(dst + p * sizeof(T), &v, sizeof(T));
      k += a[p];
    }
  }
  const int64_t tail_begin = std::max(last + 1, begin);
  std::memset(dst + tail_begin * sizeof(T), 0, (end - tail_begin) * sizeof(T));
}

// The dense positions of packed tokens, found by walking a plan's flags a
// word at a time from the last token found (or from its row's start when
// the token is before it): cheap for the increasing tokens of a layout's
// runs.
class TokenCursor {
 public:
  explicit TokenCursor(const CpuPlan& plan) : plan_(plan) {}

  // The dense position of packed token t, t < total_active.
  int64_t Find(int64_t t) {
    const std::vector<int64_t>& cu = plan_.cu_seqlens;
    if (row_ < 0 || t < token_ || t >= cu[row_ + 1]) {
      row_ = std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1;
      pos_ = row_ * plan_.seq;
      token_ = cu[row_];
    }
    // token_ is the packed index of the first active position at or after
    // pos_; t is in this row, at or after pos_.
    const uint8_t* a = plan_.active.data();
    const int64_t positions = plan_.batch * plan_.seq;
#if defined(__SSE2__)
    // Sixteen flags at a time: their sum, as two sums of eight (psadbw).
    while (pos_ + 16 <= positions) {
      const __m128i sums = _mm_sad_epu8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + pos_)),
          _mm_setzero_si128());
      const int64_t count = _mm_cvtsi128_si64(sums) +
                            _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums));
      if (token_ + count > t) break;
      token_ += count;
      pos_ += 16;
    }
#endif
    while (pos_ + 8 <= positions) {
      // Flags are bytes of 0 or 1: their sum is the top byte of the product.
      const int64_t count =
          static_cast<int64_t>((Load64(a + pos_) * kOnes) >> 56);
      if (token_ + count > t) break;
      token_ += count;
      pos_ += 8;
    }
    for (;; ++pos_) {
      if (a[pos_] == 0) continue;
      if (token_ == t) return pos_;
      ++token_;
    }
  }

 private:
  const CpuPlan& plan_;
  int64_t row_ = -1, pos_ = 0, token_ = 0;
};

using PieceFn = void (*)(const CpuPlan&, const char*, char*, int64_t, int64_t);

// The typed loop for rows of `width` bytes, or null when the width has none.
template <template <typename> class Piece>
PieceFn TypedPiece(int64_t width) {
  switch (width) {
    case 1:
      return &Piece<uint8_t>::Run;
    case 2:
      return &Piece<uint16_t>::Run;
    case 4:
      return &Piece<uint32_t>::Run;
    case 8:
      return &Piece<uint64_t>::Run;
    case 16:
      return &Piece<U128>::Run;
    default:
      return nullptr;
  }
}
template <typename T>
struct Compact {
  static void Run(const CpuPlan& p, const char* s, char* d, int64_t b,
                  int64_t e) {
    CompactPiece<T>(p, s, d, b, e);
  }
};
template <typename T>
struct Expand {
  static void Run(const CpuPlan& p, const char* s, char* d, int64_t b,
                  int64_t e) {
    ExpandPiece<T>(p, s, d, b, e);
  }
};

// True when the mask is fragmented enough that a typed loop beats one memcpy
// per run.
bool PreferTypedLoop(const CpuPlan& plan, int64_t width) {
  return plan.num_runs > 0 &&
         plan.total_active() * width < plan.num_runs * kMinRunBytesForMemcpy;
}

// Runs a piece function over dense positions split evenly across the pool.
void ForEachPositionPiece(const CpuPlan& plan, int64_t width, PieceFn fn,
                          const char* src, char* dst) {
  const int64_t positions = plan.batch * plan.seq;
  const int n = Pieces(positions * width);
  ThreadPool::Global().ParallelFor(n, [&](int i) {
    const auto [begin, end] = PieceRange(positions, i, n);
    fn(plan, src, dst, begin, end);
  });
}

class SpanBackend : public Backend {
 public:
  absl::string_view name() const override { return "span"; }

  absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(const TensorView& mask,
                                                 const Stream&) override {
    return ScanMaskPlan(mask);
  }

  absl::Status Documents(const MaskPlan& base, const TensorView& segment_ids,
                         DeviceRuntime&, DocumentCuts* out,
                         const Stream&) override {
    CutDocumentsOf(static_cast<const CpuPlan&>(base), segment_ids, out);
    return absl::OkStatus();
  }

  absl::Status PackedPositions(const MaskPlan& base,
                               std::vector<int64_t>* positions,
                               const Stream&) override {
    const auto& plan = static_cast<const CpuPlan&>(base);
    positions->clear();
    positions->reserve(plan.total_active());
    for (const Run& run : plan.runs()) {
      for (int64_t p = run.src; p < run.src + run.len; ++p) {
        positions->push_back(p);
      }
    }
    return absl::OkStatus();
  }

  // Layouts: one copy per run of consecutive rows, pad rows filled in runs;
  // the output rows split evenly across the pool.
  absl::Status GatherRows(const TensorView& x, absl::Span<const int64_t> rows,
                          const unsigned char* pad, const TensorView& out,
                          const Stream&) override {
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0 || out.nbytes() == 0) return absl::OkStatus();
    const int64_t width = out.nbytes() / n;
    const char* src = static_cast<const char*>(x.data);
    char* dst = static_cast<char*>(out.data);
    const int64_t item = ItemSize(x.dtype);
    const int pieces =
        static_cast<int>(std::min<int64_t>(Pieces(n * width), n));
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

  // Layouts as runs, straight from x: each run's packed tokens copied through
  // the mask's runs, or, for narrow rows under a mask whose runs are short,
  // compacted from the dense positions they span (the plain Pack's fused
  // loop, writing at the run's rows); pad runs filled. The output rows split
  // evenly across the pool.
  absl::Status GatherRuns(const MaskPlan& base, const TensorView& x,
                          absl::Span<const TokenRun> runs,
                          const unsigned char* pad, const TensorView& out,
                          const Stream&) override {
    const auto& plan = static_cast<const CpuPlan&>(base);
    const int64_t n = out.shape.empty() ? 0 : out.shape[0];
    if (n == 0 || out.nbytes() == 0) return absl::OkStatus();
    const int64_t width = out.nbytes() / n;
    const bool compact = !plan.all_active() && TypedPiece<Compact>(width) &&
                         PreferTypedLoop(plan, width);
    std::vector<int64_t> starts(runs.size() + 1, 0);
    for (size_t r = 0; r < runs.size(); ++r) {
      starts[r + 1] = starts[r] + runs[r].count;
    }
    static const std::vector<Run> kNone;
    const std::vector<Run>& tokens = compact ? kNone : plan.runs();
    const char* src = static_cast<const char*>(x.data);
    char* dst = static_cast<char*>(out.data);
    const int64_t item = ItemSize(x.dtype);
    // Compaction reads every dense position a run spans: as many bytes as
    // the rows' over the mask's density.
    const int64_t positions = plan.batch * plan.seq;
    const int64_t work =
        compact
            ? static_cast<int64_t>(static_cast<double>(n * width) * positions /
                                   std::max<int64_t>(plan.total_active(), 1))
            : n * width;
    const int pieces = static_cast<int>(std::min<int64_t>(Pieces(work), n));
    ThreadPool::Global().ParallelFor(pieces, [&](int p) {
      const auto [begin, end] = PieceRange(n, p, pieces);
      size_t r = std::upper_bound(starts.begin(), starts.end(), begin) -
                 starts.begin() - 1;
      TokenCursor cursor(plan);
      for (int64_t pos = begin; pos < end; ++r) {
        const int64_t skip = pos - starts[r];
        int64_t count = std::min(runs[r].count - skip, end - pos);
        if (runs[r].token < 0) {
          FillRows(dst + pos * width, count, width, pad, item);
          pos += count;
          continue;
        }
        int64_t token = runs[r].token + skip;
        if (compact) {
          const int64_t first = cursor.Find(token);
          const int64_t last = cursor.Find(token + count - 1);
          CompactFlags(plan.active.data() + first, src + first * width,
                       last + 1 - first, static_cast<int>(width),
                       dst + pos * width, count);
          pos += count;
          continue;
        }
        auto it = std::upper_bound(
            tokens.begin(), tokens.end(), token,
            [](int64_t t, const Run& run) { return t < run.dst; });
        for (--it; count > 0; ++it) {
          const int64_t k = std::min(count, it->dst + it->len - token);
          std::memcpy(dst + pos * width,
                      src + (it->src + token - it->dst) * width, k * width);
          pos += k;
          token += k;
          count -= k;
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status ScatterRows(const TensorView& packed,
                           absl::Span<const int64_t> rows,
                           const TensorView& dense, const Stream&) override {
    const int64_t positions = dense.shape[0] * dense.shape[1];
    if (positions == 0 || dense.nbytes() == 0) return absl::OkStatus();
    const int64_t width = dense.nbytes() / positions;
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
    const int pieces =
        static_cast<int>(std::min<int64_t>(Pieces(positions * width), count));
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

  absl::Status Gather(const MaskPlan& base, const TensorView& x,
                      const TensorView& out, const Stream&) override {
    const auto& plan = static_cast<const CpuPlan&>(base);
    const int64_t width = RowBytes(plan, x);
    const int64_t total = plan.total_active();
    const char* src = static_cast<const char*>(x.data);
    char* dst = static_cast<char*>(out.data);
    if (total == 0 || width == 0) return absl::OkStatus();
    if (plan.all_active()) {
      ParallelCopy(dst, src, total * width);
      return absl::OkStatus();
    }
    if (PieceFn typed = TypedPiece<Compact>(width);
        typed && PreferTypedLoop(plan, width)) {
      ForEachPositionPiece(plan, width, typed, src, dst);
      return absl::OkStatus();
    }
    // Split the packed rows evenly; each piece copies the parts of the runs
    // that land in it.
    const std::vector<Run>& runs = plan.runs();
    const int n = Pieces(total * width);
    ThreadPool::Global().ParallelFor(n, [&](int i) {
      const auto [begin, end] = PieceRange(total, i, n);
      auto it = std::upper_bound(
          runs.begin(), runs.end(), begin,
          [](int64_t row, const Run& r) { return row < r.dst; });
      for (--it; it != runs.end() && it->dst < end; ++it) {
        const int64_t lo = std::max(begin, it->dst);
        const int64_t hi = std::min(end, it->dst + it->len);
        std::memcpy(dst + lo * width, src + (it->src + lo - it->dst) * width,
                    (hi - lo) * width);
      }
    });
    return absl::OkStatus();
  }

  absl::Status Scatter(const MaskPlan& base, const TensorView& packed,
                       const TensorView& dense, const Stream&) override {
    const auto& plan = static_cast<const CpuPlan&>(base);
    const int64_t width = RowBytes(plan, dense);
    const int64_t positions = plan.batch * plan.seq;
    const char* src = static_cast<const char*>(packed.data);
    char* dst = static_cast<char*>(dense.data);
    if (positions == 0 || width == 0) return absl::OkStatus();
    if (plan.total_active() == 0) {
      ParallelZero(dst, positions * width);
      return absl::OkStatus();
    }
    if (plan.all_active()) {
      ParallelCopy(dst, src, positions * width);
      return absl::OkStatus();
    }
    if (PieceFn typed = TypedPiece<Expand>(width);
        typed && PreferTypedLoop(plan, width)) {
      ForEachPositionPiece(plan, width, typed, src, dst);
      return absl::OkStatus();
    }
    // Split the dense positions evenly; each piece zero-fills the gaps between
    // runs and copies the runs, so every dense byte is written exactly once.
    const std::vector<Run>& runs = plan.runs();
    const int n = Pieces(positions * width);
    ThreadPool::Global().ParallelFor(n, [&](int i) {
      const auto [begin, end] = PieceRange(positions, i, n);
      auto it = std::upper_bound(
          runs.begin(), runs.end(), begin,
          [](int64_t p, const Run& r) { return p < r.src + r.len; });
      int64_t pos = begin;
      for (; it != runs.end() && it->src < end; ++it) {
        const int64_t lo = std::max(begin, it->src);
        const int64_t hi = std::min(end, it->src + it->len);
        std::memset(dst + pos * width, 0, (lo - pos) * width);
        std::memcpy(dst + lo * width, src + (it->dst + lo - it->src) * width,
                    (hi - lo) * width);
        pos = hi;
      }
      std::memset(dst + pos * width, 0, (end - pos) * width);
    });
    return absl::OkStatus();
  }
};

}  // namespace

void ParallelCopy(void* dst, const void* src, size_t bytes) {
  const int n = Pieces(static_cast<int64_t>(bytes));
  ThreadPool::Global().ParallelFor(n, [&](int i) {
    const auto [begin, end] = PieceRange(static_cast<int64_t>(bytes), i, n);
    std::memcpy(static_cast<char*>(dst) + begin,
                static_cast<const char*>(src) + begin, end - begin);
  });
}

void ParallelZero(void* dst, size_t bytes) {
  const int n = Pieces(static_cast<int64_t>(bytes));
  ThreadPool::Global().ParallelFor(n, [&](int i) {
    const auto [begin, end] = PieceRange(static_cast<int64_t>(bytes), i, n);
    std::memset(static_cast<char*>(dst) + begin, 0, end - begin);
  });
}

void RegisterCpuBackends(Registry& registry) {
  registry
      .Add(DeviceKind::kCpu, std::make_unique<SpanBackend>(),
           /*make_default=*/true)
      .IgnoreError();
}

}  // namespace packd
