// The mask scan's row loops (kernels/cpu/mask_scan.h) on every path this CPU
// can run, against the plain definition: rows of every length from 0 to
// 1,031 (crossing every vector width), starting at every misalignment, at
// densities from empty to full, with the predecessor set and clear.
#include "kernels/cpu/mask_scan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <vector>

namespace packd {
namespace {

struct Expected {
  std::vector<uint8_t> flags;
  int64_t count = 0, starts = 0;
};

Expected Definition(const uint8_t* m, uint8_t magnitude, int64_t n,
                    uint8_t before) {
  Expected e;
  uint8_t prev = before;
  for (int64_t s = 0; s < n; ++s) {
    const uint8_t on = (m[s] & magnitude) != 0;
    e.flags.push_back(on);
    e.count += on;
    e.starts += on && !prev;
    prev = on;
  }
  return e;
}

std::vector<VectorPath> Runnable() {
  std::vector<VectorPath> paths;
  for (VectorPath p : {VectorPath::kPortable, VectorPath::kSse2,
                       VectorPath::kAvx2, VectorPath::kAvx512}) {
    if (CanRun(p)) paths.push_back(p);
  }
  return paths;
}

TEST(MaskScan, EveryPathEqualsTheDefinition) {
  std::mt19937_64 rng(std::random_device{}());
  for (VectorPath path : Runnable()) {
    SCOPED_TRACE(std::string(VectorPathName(path)));
    int64_t cases = 0;
    for (int64_t n = 0; n <= 1031; ++n) {
      const int64_t offset = n % 33;  // every misalignment, up to 32 bytes
      std::vector<uint8_t> m(n + offset + 1), flags(n + offset + 1, 0xa5);
      const double density = (n % 11) / 10.0;
      for (int64_t s = 0; s < n; ++s) {
        // Mask bytes of every kind: 0, 1, and others, some set only in bits
        // the magnitude drops.
        const uint64_t r = rng();
        m[offset + s] = (r % 1000) < density * 1000
                            ? static_cast<uint8_t>(1 + (r >> 10) % 255)
                            : ((r >> 20) % 4 == 0 ? 0x80 : 0);
      }
      for (uint8_t magnitude : {uint8_t{0xff}, uint8_t{0x7f}}) {
        for (uint8_t before : {uint8_t{0}, uint8_t{1}}) {
          const Expected want =
              Definition(m.data() + offset, magnitude, n, before);
          int64_t starts = -1;
          const int64_t count =
              ScanByteRow(m.data() + offset, magnitude, n, before,
                          flags.data() + offset, &starts, path);
          ASSERT_EQ(count, want.count) << "n " << n;
          ASSERT_EQ(starts, want.starts) << "n " << n;
          ASSERT_EQ(std::vector<uint8_t>(flags.begin() + offset,
                                         flags.begin() + offset + n),
                    want.flags)
              << "n " << n;
          EXPECT_EQ(flags[offset + n], 0xa5) << "wrote past the row, n " << n;
          starts = -1;
          EXPECT_EQ(CountFlags(flags.data() + offset, n, before, &starts, path),
                    want.count);
          EXPECT_EQ(starts, want.starts);
          ++cases;
        }
      }
    }
    EXPECT_EQ(cases, 4 * 1032);
  }
}

// Compaction of flagged elements of every width, on every path: exactly the
// flagged ones in order, nothing written past `room` (the count, or more),
// whatever the alignment.
TEST(MaskScan, CompactionTakesTheFlaggedElementsInOrder) {
  std::mt19937_64 rng(std::random_device{}());
  for (VectorPath path : Runnable()) {
    SCOPED_TRACE(std::string(VectorPathName(path)));
    for (int width : {1, 2, 4, 8, 16}) {
      for (int64_t n = 0; n <= 300; ++n) {
        const int64_t offset = n % 7;
        std::vector<uint8_t> flags(n + offset);
        std::vector<unsigned char> src((n + offset) * width + 1);
        for (auto& c : src) c = static_cast<unsigned char>(rng());
        const double density = (n % 5) / 4.0;
        std::vector<unsigned char> want;
        for (int64_t s = 0; s < n; ++s) {
          flags[offset + s] = (rng() % 100) < density * 100;
          if (flags[offset + s]) {
            want.insert(want.end(), src.begin() + 1 + (offset + s) * width,
                        src.begin() + 1 + (offset + s + 1) * width);
          }
        }
        const int64_t count = static_cast<int64_t>(want.size()) / width;
        for (int64_t room : {count, count + 40}) {
          // Both ends one byte off any alignment: an element is a row of
          // bytes, which need not be aligned for a value of its width.
          std::vector<unsigned char> out((room + 1) * width + 1, 0xa5);
          unsigned char* to = out.data() + 1;
          ASSERT_EQ(CompactFlags(flags.data() + offset,
                                 src.data() + 1 + offset * width, n, width, to,
                                 room, path),
                    count)
              << "width " << width << " n " << n;
          ASSERT_TRUE(std::equal(want.begin(), want.end(), to))
              << "width " << width << " n " << n;
          for (int64_t i = room * width; i < (room + 1) * width; ++i) {
            ASSERT_EQ(to[i], 0xa5) << "wrote past room, width " << width;
          }
        }
      }
    }
  }
}

// Neighbour changes of every element width, lengths crossing every vector
// width, misaligned starts, ids that change rarely (documents) or often; the
// word after the last is left alone.
TEST(MaskScan, NeighbourChangesMarkEveryElementThatDiffersFromTheNext) {
  std::mt19937_64 rng(std::random_device{}());
  for (VectorPath path : Runnable()) {
    SCOPED_TRACE(std::string(VectorPathName(path)));
    for (int width : {1, 2, 4, 8}) {
      for (int64_t n = 0; n <= 1031; ++n) {
        const int64_t offset = n % 9;
        std::vector<unsigned char> v((n + offset) * width + 1);
        // Runs of equal elements, some one long; an element may differ from
        // its neighbour in one byte only.
        for (int64_t j = 0; j < n; ++j) {
          unsigned char* e = v.data() + 1 + (offset + j) * width;
          if (j > 0 && rng() % 8 != 0) {
            std::copy(e - width, e, e);
          } else if (j > 0 && rng() % 2 == 0) {
            std::copy(e - width, e, e);
            e[rng() % width] ^= static_cast<unsigned char>(1 + rng() % 255);
          } else {
            for (int i = 0; i < width; ++i)
              e[i] = static_cast<unsigned char>(rng());
          }
        }
        const unsigned char* at = v.data() + 1 + offset * width;
        const int64_t words = (n + 62) / 64;
        std::vector<uint64_t> bits(words + 1, 0xa5a5a5a5a5a5a5a5ULL),
            want(words, 0);
        for (int64_t j = 0; j + 1 < n; ++j) {
          if (!std::equal(at + j * width, at + (j + 1) * width,
                          at + (j + 1) * width)) {
            want[j / 64] |= uint64_t{1} << (j % 64);
          }
        }
        NeighbourChanges(at, n, width, bits.data(), path);
        for (int64_t w = 0; w < words; ++w) {
          ASSERT_EQ(bits[w], want[w])
              << "width " << width << " n " << n << " word " << w;
        }
        ASSERT_EQ(bits[words], 0xa5a5a5a5a5a5a5a5ULL)
            << "wrote past the words, n " << n;
      }
    }
  }
}

// The path taken is the best this CPU has, unless PACKD_CPU_VECTORS=off asks
// for the portable one (ctest runs kernels_test both ways).
TEST(MaskScan, TheBestPathIsTakenUnlessTurnedOff) {
  const char* env = std::getenv("PACKD_CPU_VECTORS");
  const bool off = env != nullptr && std::string(env) == "off";
  const VectorPath best = Runnable().back();
  EXPECT_EQ(ChosenVectorPath(), off ? VectorPath::kPortable : best)
      << "chosen " << VectorPathName(ChosenVectorPath()) << ", best "
      << VectorPathName(best);
#if defined(__x86_64__)
  EXPECT_TRUE(CanRun(VectorPath::kSse2));  // every x86-64 has it
  if (__builtin_cpu_supports("avx2")) EXPECT_TRUE(CanRun(VectorPath::kAvx2));
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt")) {
    EXPECT_TRUE(CanRun(VectorPath::kAvx512));
  }
#endif
  std::printf("mask scan path: %s\n",
              std::string(VectorPathName(ChosenVectorPath())).c_str());
}

}  // namespace
}  // namespace packd
