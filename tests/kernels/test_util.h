// Helpers for the kernel tests: fresh random tensors and masks of every dtype,
// output canaries, and the libtorch reference results every packd result is
// compared against, byte for byte.
//
// clang-format off
//   Rng rng = Rng::Fresh();
//   at::Tensor mask = RandomMask(rng, DType::kFloat32, 4, 16, 0.3, MaskPattern::kHoles);
//   EXPECT_TRUE(SameBytes(ReferencePack(x, mask), result.packed[0].view));
// clang-format on
#ifndef PACKD_TESTS_KERNELS_TEST_UTIL_H_
#define PACKD_TESTS_KERNELS_TEST_UTIL_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/tensor_view.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "workloads/mask_patterns.h"

namespace packd::testing {

// A seeded generator; Fresh() seeds from the clock and prints the seed so a
// failure can be replayed with PACKD_TEST_SEED.
struct Rng {
  std::mt19937_64 engine;
  static Rng Fresh();
  uint64_t Next() { return engine(); }
  double Uniform() {
    return std::uniform_real_distribution<double>(0, 1)(engine);
  }
};

// A [B, S] mask of `dtype` whose active positions follow `kind` and `density`.
// Active values are varied nonzero values (2, -1, 0.5, NaN, -inf...), inactive
// ones are 0 and, for floats, -0.0.
at::Tensor RandomMask(Rng& rng, DType dtype, int64_t B, int64_t S,
                      double density, MaskPattern kind);

// A tensor of `shape` filled with random bytes (bool: 0 or 1), so NaN payloads
// and -0.0 occur.
at::Tensor RandomTensor(Rng& rng, DType dtype,
                        const std::vector<int64_t>& shape);

// An integer view of `t`'s bits, of the same element size: what references
// select and compare, so that NaN payloads and -0.0 move unchanged.
at::Tensor Bits(const at::Tensor& t);

// x[mask != 0] and its inverse, computed by libtorch's own boolean indexing.
at::Tensor ReferencePack(const at::Tensor& x, const at::Tensor& mask);
at::Tensor ReferenceScatter(const at::Tensor& packed, const at::Tensor& mask,
                            const std::vector<int64_t>& dense_shape);

// Reference metadata computed with torch ops from mask != 0.
struct ReferenceMeta {
  std::vector<int64_t> cu_seqlens, position_ids, last_index;
  int64_t total_active = 0, max_seqlen = 0;
};
ReferenceMeta ReferenceMetadata(const at::Tensor& mask);

// Byte-for-byte comparisons with a torch result. SameBytes: success when
// `actual` has expected's dtype, shape and bytes; SameBytesAt: when the
// expected.nbytes() bytes at `actual` equal expected's. A failure says where
// they first differ (and whether that byte is the canary).
::testing::AssertionResult SameBytes(const at::Tensor& expected,
                                     const TensorView& actual);
::testing::AssertionResult SameBytes(const at::Tensor& expected,
                                     const at::Tensor& actual);
::testing::AssertionResult SameBytesAt(const at::Tensor& expected,
                                       const void* actual);

// Fills `t` with the canary byte so that an element the op never writes is
// caught.
constexpr uint8_t kCanary = 0xA5;
void FillCanary(at::Tensor& t);

// Device 0 of the GPU kind this build has (hip:0 in a ROCm build, else
// cuda:0), whether or not the machine has one.
Device FirstGpu();

std::vector<int64_t> Concat(std::vector<int64_t> head,
                            const std::vector<int64_t>& tail);

}  // namespace packd::testing

#endif  // PACKD_TESTS_KERNELS_TEST_UTIL_H_
