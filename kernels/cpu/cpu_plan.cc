#include "kernels/cpu/cpu_plan.h"

#include <algorithm>

#include "base/dtype.h"
#include "kernels/cpu/mask_scan.h"
#include "kernels/thread_pool.h"

namespace packd::cpu_internal {

void CpuPlan::BuildRuns() const {
  const uint8_t* a = active.data();
  runs_.reserve(num_runs);
  // A run that ends a row and one that starts the next are one run.
  auto add = [&](int64_t src, int64_t dst, int64_t len) {
    if (!runs_.empty() && runs_.back().src + runs_.back().len == src) {
      runs_.back().len += len;
    } else {
      runs_.push_back(Run{src, dst, len});
    }
  };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = cu_seqlens[b + 1] - cu_seqlens[b];
    if (count == 0) continue;
    const int64_t end = b * seq + last_index[b] + 1;
    if (row_runs[b] == 1) {  // the row's tokens end at last_index
      add(end - count, cu_seqlens[b], count);
      continue;
    }
    int64_t i = b * seq, dst = cu_seqlens[b];
    while (i < end) {
      while (i + 8 <= end && Load64(a + i) == 0) i += 8;
      while (a[i] == 0) ++i;  // a flag is set before end
      const int64_t start = i;
      while (i + 8 <= end && Load64(a + i) == kOnes) i += 8;
      while (i < end && a[i] != 0) ++i;
      add(start, dst, i - start);
      dst += i - start;
    }
  }
}

namespace {

// Index of the last nonzero byte in [0, n), or -1.
int64_t LastNonzero(const uint8_t* a, int64_t n) {
  int64_t i = n;
  while (i >= 8 && Load64(a + i - 8) == 0) i -= 8;
  while (i > 0 && a[i - 1] == 0) --i;
  return i - 1;
}

// Scans rows [b0, b1) of a mask of element type U into plan.active, the per-row
// counts (in cu_seqlens[b + 1], summed later) and last_index; returns how many
// runs start in those rows. `magnitude` keeps the bits that make a value
// nonzero: all of them for integers, all but the sign for floats (so -0.0 is
// inactive and NaN is active). The inner loops are mask_scan.h's.
template <typename U>
int64_t ScanRows(const U* m, U magnitude, CpuPlan& plan, int64_t b0,
                 int64_t b1) {
  const int64_t S = plan.seq;
  const VectorPath path = ChosenVectorPath();
  int64_t runs = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const U* row = m + b * S;
    uint8_t* act = plan.active.data() + b * S;
    // A run starts at each active position whose predecessor, which for s = 0
    // is the previous row's last position, is inactive.
    const uint8_t before = b > 0 && S > 0 && (m[b * S - 1] & magnitude) != 0;
    int64_t starts = 0, count = 0;
    if constexpr (sizeof(U) == 1) {
      count = ScanByteRow(reinterpret_cast<const uint8_t*>(row),
                          static_cast<uint8_t>(magnitude), S, before, act,
                          &starts, path);
    } else {
      // The flags (a compare and a store, vectorised), then counted in a
      // second pass: a byte count summed into an int64 in the same loop
      // widens every byte to 64 bits.
      for (int64_t s = 0; s < S; ++s) act[s] = (row[s] & magnitude) != 0;
      count = CountFlags(act, S, before, &starts, path);
    }
    plan.cu_seqlens[b + 1] = count;
    plan.last_index[b] = count == 0 ? -1 : LastNonzero(act, S);
    plan.row_runs[b] = starts + (before & (S > 0 ? act[0] : 0));
    runs += starts;
  }
  return runs;
}

// Rows of the mask per scan piece: below this many positions one thread scans
// faster.
constexpr int64_t kMinPositionsPerScanPiece = int64_t{1} << 20;

template <typename U>
void ScanMask(const U* m, U magnitude, CpuPlan& plan) {
  const int64_t positions = plan.batch * plan.seq;
  const int n = static_cast<int>(std::min<int64_t>(
      {ThreadPool::Global().num_threads(), plan.batch,
       std::max<int64_t>(1, positions / kMinPositionsPerScanPiece)}));
  std::vector<int64_t> runs(std::max(n, 1), 0);
  ThreadPool::Global().ParallelFor(n, [&](int i) {
    runs[i] = ScanRows(m, magnitude, plan, plan.batch * i / n,
                       plan.batch * (i + 1) / n);
  });
  for (int64_t b = 0; b < plan.batch; ++b)
    plan.cu_seqlens[b + 1] += plan.cu_seqlens[b];
  plan.num_runs = 0;
  for (int64_t r : runs) plan.num_runs += r;
}

// Calls fn(j) for each j in [1, n) where v[j] != v[j - 1], in order: the
// compares a block at a time into bits, in vectors (NeighbourChanges), then
// the rare changes found a word at a time by their set bits.
template <typename T, typename Fn>
void ForEachChange(const T* v, int64_t n, Fn&& fn) {
  constexpr int64_t kBlock = 1024;  // pairs a block
  uint64_t bits[kBlock / 64];
  for (int64_t base = 0; base + 1 < n; base += kBlock) {
    const int64_t m = std::min(kBlock + 1, n - base);  // elements
    NeighbourChanges(v + base, m, sizeof(T), bits);
    for (int64_t w = 0; 64 * w < m - 1; ++w) {
      for (uint64_t word = bits[w]; word != 0; word &= word - 1) {
        fn(base + 64 * w + __builtin_ctzll(word) + 1);
      }
    }
  }
}

// The first set flag of a[i, n), or n; and the last set flag of a[0, i), or
// -1: eight flags a word over runs of zeros.
int64_t NextFlag(const uint8_t* a, int64_t i, int64_t n) {
  while (i + 8 <= n && Load64(a + i) == 0) i += 8;
  while (i < n && a[i] == 0) ++i;
  return i;
}
int64_t PreviousFlag(const uint8_t* a, int64_t i) {
  while (i >= 8 && Load64(a + i - 8) == 0) i -= 8;
  while (i > 0 && a[i - 1] == 0) --i;
  return i - 1;
}

// Flags set in a[from, to), eight a word.
int64_t FlagsIn(const uint8_t* a, int64_t from, int64_t to) {
  int64_t c = 0;
  for (; from + 8 <= to; from += 8) {
    c += static_cast<int64_t>((Load64(a + from) * kOnes) >> 56);
  }
  for (; from < to; ++from) c += a[from];
  return c;
}

// The document starts of rows [b0, b1): for each, its dense position, its
// row, and the last token before it (a column, maybe of an earlier row).
struct DocumentStarts {
  std::vector<int64_t> cu, row, previous_last;
};

// A document starts at a row's first token and at each token whose id differs
// from the token before it in the row. Ids are compared across the whole row
// in vectors (ForEachChange): between two consecutive tokens the id changes
// only if some raw position between them changes, so only those changes, rare
// (one per document boundary), are looked at: the tokens either side of the
// change (a search of the flags, eight at a time), and, where their ids
// differ, the later one's dense position (the flags counted on from the last
// start). The ids are never gathered and no position has a branch.
template <typename T>
void CutDocumentRows(const CpuPlan& plan, const T* ids, int64_t b0, int64_t b1,
                     DocumentStarts* out) {
  const int64_t S = plan.seq;
  int64_t previous_last = -1;  // the last token before row b
  for (int64_t b = b0 - 1; b >= 0 && previous_last < 0; --b) {
    previous_last = plan.last_index[b];
  }
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = plan.cu_seqlens[b];
    const int64_t n = plan.cu_seqlens[b + 1] - k0;
    if (n == 0) continue;
    const uint8_t* act = plan.active.data() + b * S;
    const T* row = ids + b * S;
    const int64_t end = plan.last_index[b] + 1;
    const bool one_run = plan.row_runs[b] == 1;
    const int64_t first = one_run ? end - n : NextFlag(act, 0, end);
    auto start = [&](int64_t s, int64_t j, int64_t last) {
      out->cu.push_back(k0 + j);
      out->row.push_back(b);
      out->previous_last.push_back(last);
    };
    start(first, 0, previous_last);
    if (one_run) {  // every position from first to end is a token
      ForEachChange(row + first, n,
                    [&](int64_t j) { start(first + j, j, first + j - 1); });
    } else {
      int64_t decided = first;  // changes at or before it are looked at
      int64_t counted_to = first, rank = 0;  // rank: flags before counted_to
      ForEachChange(row + first, end - first, [&](int64_t c) {
        c += first;
        if (c <= decided) return;  // in the gap before a token looked at
        const int64_t q = NextFlag(act, c, end);  // end - 1 is a token
        decided = q;
        const int64_t p = PreviousFlag(act, c);  // first is a token
        if (row[q] == row[p]) return;
        rank += FlagsIn(act, counted_to, q);
        counted_to = q;
        start(q, rank, p);
      });
    }
    previous_last = end - 1;
  }
}

// Rows of the mask per document-cut piece: below this many positions one
// thread cuts faster.
constexpr int64_t kMinPositionsPerCutPiece = int64_t{1} << 17;

// Documents of the whole mask, cut in pieces of rows across the pool and
// joined: a document's last token is the one before the next start.
template <typename T>
void CutDocuments(const CpuPlan& plan, const T* ids, DocumentCuts* out) {
  const int64_t positions = plan.batch * plan.seq;
  const int n = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({ThreadPool::Global().num_threads(), plan.batch,
                            positions / kMinPositionsPerCutPiece})));
  std::vector<DocumentStarts> pieces(n);
  ThreadPool::Global().ParallelFor(n, [&](int i) {
    CutDocumentRows(plan, ids, plan.batch * i / n, plan.batch * (i + 1) / n,
                    &pieces[i]);
  });
  out->cu.clear();
  out->row.clear();
  out->last_index.clear();
  for (const DocumentStarts& piece : pieces) {
    out->cu.insert(out->cu.end(), piece.cu.begin(), piece.cu.end());
    out->row.insert(out->row.end(), piece.row.begin(), piece.row.end());
    out->last_index.insert(out->last_index.end(), piece.previous_last.begin(),
                           piece.previous_last.end());
  }
  if (!out->last_index.empty()) {
    // previous_last[d + 1] is document d's last token; the last ends its row.
    out->last_index.erase(out->last_index.begin());
    out->last_index.push_back(plan.last_index[out->row.back()]);
  }
  out->cu.push_back(plan.total_active());
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuPlan>> ScanMaskPlan(const TensorView& mask) {
  auto plan = std::make_unique<CpuPlan>();
  plan->batch = mask.shape[0];
  plan->seq = mask.shape[1];
  plan->cu_seqlens.assign(plan->batch + 1, 0);
  plan->last_index.assign(plan->batch, -1);
  plan->row_runs.assign(plan->batch, 0);
  PACKD_RETURN_IF_ERROR(plan->active.Allocate(plan->batch * plan->seq));
  const uint64_t bits = NonzeroBits(mask.dtype);
  switch (ItemSize(mask.dtype)) {
    case 1:
      ScanMask<uint8_t>(static_cast<const uint8_t*>(mask.data),
                        static_cast<uint8_t>(bits), *plan);
      break;
    case 2:
      ScanMask<uint16_t>(static_cast<const uint16_t*>(mask.data),
                         static_cast<uint16_t>(bits), *plan);
      break;
    case 4:
      ScanMask<uint32_t>(static_cast<const uint32_t*>(mask.data),
                         static_cast<uint32_t>(bits), *plan);
      break;
    default:
      ScanMask<uint64_t>(static_cast<const uint64_t*>(mask.data), bits, *plan);
      break;
  }
  return plan;
}

void CutDocumentsOf(const CpuPlan& plan, const TensorView& segment_ids,
                    DocumentCuts* out) {
  switch (segment_ids.dtype) {
    case DType::kUInt8:
      CutDocuments(plan, static_cast<const uint8_t*>(segment_ids.data), out);
      break;
    case DType::kInt8:
      CutDocuments(plan, static_cast<const int8_t*>(segment_ids.data), out);
      break;
    case DType::kInt16:
      CutDocuments(plan, static_cast<const int16_t*>(segment_ids.data), out);
      break;
    case DType::kInt32:
      CutDocuments(plan, static_cast<const int32_t*>(segment_ids.data), out);
      break;
    default:
      CutDocuments(plan, static_cast<const int64_t*>(segment_ids.data), out);
      break;
  }
}

}  // namespace packd::cpu_internal
