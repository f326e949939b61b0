#include "tests/kernels/test_util.h"

#include <ATen/TensorIndexing.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/torch_interop.h"
#include "kernels/registry.h"

namespace packd::testing {

Rng Rng::Fresh() {
  uint64_t seed = std::chrono::steady_clock::now().time_since_epoch().count();
  if (const char* env = std::getenv("PACKD_TEST_SEED")) {
    absl::SimpleAtoi(env, &seed);
  }
  static bool printed = false;
  if (!printed) {
    std::cerr << "random seed: PACKD_TEST_SEED=" << seed << "\n";
    printed = true;
  }
  static uint64_t calls = 0;
  return Rng{std::mt19937_64(seed + 0x9E3779B97F4A7C15ULL * ++calls)};
}

at::Tensor RandomMask(Rng& rng, DType dtype, int64_t B, int64_t S,
                      double density, MaskPattern kind) {
  const std::vector<uint8_t> a = MaskActivity(kind, B, S, density, rng.engine);
  at::Tensor values = at::zeros({B, S}, at::kDouble);
  double* out = values.data_ptr<double>();
  const double kActive[] = {1.0, 2.0, -1.0, 0.5, 100.0};
  const double kFloatActive[] = {std::numeric_limits<double>::quiet_NaN(),
                                 -std::numeric_limits<double>::infinity(),
                                 1e-30, -3.5};
  for (int64_t i = 0; i < B * S; ++i) {
    double v = 0.0;
    if (a[i]) {
      const uint64_t r = rng.Next();
      if (dtype == DType::kBool) {
        v = 1.0;
      } else if (IsFloatingPoint(dtype) && r % 3 == 0) {
        v = kFloatActive[(r / 3) % 4];
        // bf16/f16 flush 1e-30 to zero; keep it active by using the smallest
        // normal instead.
        if (v == 1e-30 && dtype != DType::kFloat32 && dtype != DType::kFloat64)
          v = 1e-3;
      } else {
        v = kActive[r % 5];
        if (dtype == DType::kUInt8 && v < 0) v = 255;
      }
    } else if (IsFloatingPoint(dtype) && (rng.Next() & 1)) {
      v = -0.0;
    }
    out[i] = v;
  }
  return values.to(ToScalarType(dtype));
}

at::Tensor RandomTensor(Rng& rng, DType dtype,
                        const std::vector<int64_t>& shape) {
  at::Tensor t = at::empty(shape, ToScalarType(dtype));
  auto* bytes = static_cast<uint8_t*>(t.data_ptr());
  const int64_t n = t.nbytes();
  for (int64_t i = 0; i < n; i += 8) {
    const uint64_t r = rng.Next();
    std::memcpy(bytes + i, &r, std::min<int64_t>(8, n - i));
  }
  if (dtype == DType::kBool) {
    for (int64_t i = 0; i < n; ++i) bytes[i] &= 1;
  }
  return t;
}

// torch's boolean indexing on floating types can convert values: index_put_
// with a single value goes through a scalar and returns the canonical NaN,
// dropping payload and sign. On integers it only moves bits, which is what the
// references must do.
at::Tensor Bits(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1:
      return t.contiguous().view(at::kByte);
    case 2:
      return t.contiguous().view(at::kShort);
    case 4:
      return t.contiguous().view(at::kInt);
    default:
      return t.contiguous().view(at::kLong);
  }
}

at::Tensor ReferencePack(const at::Tensor& x, const at::Tensor& mask) {
  return Bits(x).index({mask.ne(0)}).view(x.scalar_type());
}

at::Tensor ReferenceScatter(const at::Tensor& packed, const at::Tensor& mask,
                            const std::vector<int64_t>& dense_shape) {
  const at::Tensor bits = Bits(packed);
  at::Tensor dense = at::zeros(dense_shape, bits.options());
  dense.index_put_({mask.ne(0)}, bits);
  return dense.view(packed.scalar_type());
}

ReferenceMeta ReferenceMetadata(const at::Tensor& mask) {
  ReferenceMeta meta;
  const at::Tensor active = mask.ne(0);
  const int64_t B = mask.size(0), S = mask.size(1);
  const at::Tensor counts = active.sum(1, false, at::kLong);
  const at::Tensor cu = at::cat({at::zeros({1}, at::kLong), counts.cumsum(0)});
  meta.cu_seqlens.assign(cu.data_ptr<int64_t>(),
                         cu.data_ptr<int64_t>() + cu.numel());
  meta.total_active = meta.cu_seqlens.back();
  meta.max_seqlen = B == 0 ? 0 : counts.max().item<int64_t>();
  const at::Tensor pos =
      (active.to(at::kLong).cumsum(1) - 1).index({active}).contiguous();
  meta.position_ids.assign(pos.data_ptr<int64_t>(),
                           pos.data_ptr<int64_t>() + pos.numel());
  // Last active s per row: max over s of (s where active, else -1).
  const at::Tensor s_index = at::arange(S, at::kLong).expand({B, S});
  const at::Tensor last =
      B == 0   ? at::empty({0}, at::kLong)
      : S == 0 ? at::full({B}, -1, at::kLong)
               : at::where(active, s_index, at::full({}, -1, at::kLong))
                     .amax(1)
                     .contiguous();
  meta.last_index.assign(last.data_ptr<int64_t>(),
                         last.data_ptr<int64_t>() + last.numel());
  return meta;
}

::testing::AssertionResult SameBytesAt(const at::Tensor& expected_in,
                                       const void* actual) {
  const at::Tensor expected = expected_in.contiguous();
  const int64_t n = expected.nbytes();
  if (n == 0) return ::testing::AssertionSuccess();
  const auto* e = static_cast<const uint8_t*>(expected.data_ptr());
  const auto* a = static_cast<const uint8_t*>(actual);
  if (std::memcmp(e, a, n) == 0) return ::testing::AssertionSuccess();
  int64_t i = 0;
  while (e[i] == a[i]) ++i;
  return ::testing::AssertionFailure()
         << "first differing byte at offset " << i << " of " << n
         << ": expected " << static_cast<int>(e[i]) << ", got "
         << static_cast<int>(a[i])
         << (a[i] == kCanary ? " (the canary: never written)" : "");
}

::testing::AssertionResult SameBytes(const at::Tensor& expected,
                                     const TensorView& actual) {
  const std::vector<int64_t> shape(actual.shape.begin(), actual.shape.end());
  if (expected.sizes().vec() != shape) {
    return ::testing::AssertionFailure()
           << "shape " << ShapeString(actual.shape) << " != expected "
           << ShapeString(expected.sizes().vec());
  }
  if (ToScalarType(actual.dtype) != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "dtype " << DTypeName(actual.dtype) << " != expected "
           << c10::toString(expected.scalar_type());
  }
  return SameBytesAt(expected, actual.data);
}

::testing::AssertionResult SameBytes(const at::Tensor& expected,
                                     const at::Tensor& actual) {
  const DType dtype = FromScalarType(actual.scalar_type());
  if (dtype == DType::kUnspecified) {
    return ::testing::AssertionFailure()
           << "dtype " << c10::toString(actual.scalar_type());
  }
  return SameBytes(expected, AsView(actual.contiguous()));
}

void FillCanary(at::Tensor& t) {
  if (t.nbytes() > 0) std::memset(t.data_ptr(), kCanary, t.nbytes());
}

std::vector<int64_t> Concat(std::vector<int64_t> head,
                            const std::vector<int64_t>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

Device FirstGpu() {
  const bool hip = !Registry::Global().Names(DeviceKind::kHip).empty();
  return Device{hip ? DeviceKind::kHip : DeviceKind::kCuda, 0};
}

}  // namespace packd::testing
