// The mask scan's inner loops, one row at a time, and the compaction of
// active elements, with the vector instructions the CPU has: AVX-512 (its
// compress stores) and AVX2 where it has them, else SSE2 (every x86-64), else
// portable code that works eight positions at a time. The path is chosen
// once from the CPU; PACKD_CPU_VECTORS=off in the environment forces the
// portable one (tests run both).
//
// clang-format off
//   int64_t starts = 0;
//   const int64_t count = ScanByteRow(row, 0xff, S, before, flags, &starts);
// clang-format on
#ifndef PACKD_KERNELS_CPU_MASK_SCAN_H_
#define PACKD_KERNELS_CPU_MASK_SCAN_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace packd {

// In order: each path includes the ones before it.
enum class VectorPath { kPortable, kSse2, kAvx2, kAvx512 };

// The path this process uses: the best the CPU has, or kPortable when
// PACKD_CPU_VECTORS=off.
VectorPath ChosenVectorPath();
// Whether this CPU (and build) can run `path`.
bool CanRun(VectorPath path);
// "avx512", "avx2", "sse2" or "portable".
absl::string_view VectorPathName(VectorPath path);

// One row of a 1-byte mask: flags[s] = (m[s] & magnitude) != 0 for s in
// [0, n). Returns how many are set, and in *starts how many runs of set flags
// start in the row: set positions whose predecessor (`before` for s = 0) is
// not. `path` must be one CanRun allows.
int64_t ScanByteRow(const uint8_t* m, uint8_t magnitude, int64_t n,
                    uint8_t before, uint8_t* flags, int64_t* starts,
                    VectorPath path = ChosenVectorPath());

// The same counts of flags already written (each 0 or 1).
int64_t CountFlags(const uint8_t* flags, int64_t n, uint8_t before,
                   int64_t* starts, VectorPath path = ChosenVectorPath());

// Compacts the elements of `src` (n of `width` bytes: 1, 2, 4, 8 or 16) whose
// flag is set into `out`, in order; returns how many. `room`: the elements
// `out` may be written at, at least the count (it is written nowhere past
// them). AVX-512 compresses 4- and 8-byte elements sixteen or eight at a
// time, storing whole vectors while they fit in `room`; other widths, and
// other paths, copy every element up to the last flagged one to the cursor
// and advance it by its flag (no branch).
int64_t CompactFlags(const uint8_t* flags, const void* src, int64_t n,
                     int width, void* out, int64_t room,
                     VectorPath path = ChosenVectorPath());

// Where neighbours differ: bit j of `bits` (64 a word, (n + 62) / 64 words)
// is set where element j of `v` (n of `width` bytes: 1, 2, 4 or 8) differs
// from element j + 1, for j in [0, n - 1). AVX-512 compares sixteen 4-byte or
// eight 8-byte elements into a mask at once, AVX2 eight to thirty-two into a
// movemask; other paths one at a time.
void NeighbourChanges(const void* v, int64_t n, int width, uint64_t* bits,
                      VectorPath path = ChosenVectorPath());

}  // namespace packd

#endif  // PACKD_KERNELS_CPU_MASK_SCAN_H_
