// Synthetic masks: which positions of a [B, S] batch are active, in the two
// patterns that packd's benchmarks, tests, GPU check and packctl generate.
// Header-only and standard C++ only, so that nvcc-only builds use it too.
//
// clang-format off
//   std::mt19937_64 rng(7);
//   std::vector<uint8_t> active = MaskActivity(MaskPattern::kPrefix, B, S, 0.3, rng);
// clang-format on
#ifndef PACKD_WORKLOADS_MASK_PATTERNS_H_
#define PACKD_WORKLOADS_MASK_PATTERNS_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

namespace packd {

// prefix: each row active for a prefix (a completion, then padding) whose
// length is min(1, density * U(0.5, 1.5)) * S, so rows differ and the batch
// keeps about `density`; density >= 1 fills every row, density <= 0 none.
// holes: each position active on its own with probability `density`.
enum class MaskPattern { kPrefix, kHoles };

// "prefix", or "holes" (also "random"); false for anything else.
inline bool ParseMaskPattern(std::string_view text, MaskPattern* pattern) {
  if (text == "prefix") {
    *pattern = MaskPattern::kPrefix;
  } else if (text == "holes" || text == "random") {
    *pattern = MaskPattern::kHoles;
  } else {
    return false;
  }
  return true;
}

inline const char* MaskPatternName(MaskPattern pattern) {
  return pattern == MaskPattern::kPrefix ? "prefix" : "holes";
}

// [B * S] flags, row-major, 1 where the position is active.
inline std::vector<uint8_t> MaskActivity(MaskPattern pattern, int64_t B,
                                         int64_t S, double density,
                                         std::mt19937_64& rng) {
  std::vector<uint8_t> active(static_cast<size_t>(B * S), 0);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t b = 0; b < B; ++b) {
    uint8_t* row = active.data() + b * S;
    if (pattern == MaskPattern::kPrefix) {
      const double f = density >= 1.0 ? 1.0
                       : density <= 0.0
                           ? 0.0
                           : std::min(1.0, density * (0.5 + u(rng)));
      std::fill(row, row + static_cast<int64_t>(f * S), 1);
    } else {
      for (int64_t s = 0; s < S; ++s) row[s] = u(rng) < density;
    }
  }
  return active;
}

}  // namespace packd

#endif  // PACKD_WORKLOADS_MASK_PATTERNS_H_
