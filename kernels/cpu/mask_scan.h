// The mask scan's inner loops, one row at a time, with the vector
// instructions the CPU has: AVX2 where it has them, else SSE2 (every x86-64),
// else portable code that works eight positions at a time. The path is chosen
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

enum class VectorPath { kPortable, kSse2, kAvx2 };

// The path this process uses: the best the CPU has, or kPortable when
// PACKD_CPU_VECTORS=off.
VectorPath ChosenVectorPath();
// Whether this CPU (and build) can run `path`.
bool CanRun(VectorPath path);
absl::string_view VectorPathName(
    VectorPath path);  // "avx2", "sse2", "portable"

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

}  // namespace packd

#endif  // PACKD_KERNELS_CPU_MASK_SCAN_H_
