// Pack and Scatter against libtorch's boolean indexing, byte for byte, on fresh
// random data: every dtype of x and of the mask, edge and odd shapes, tails,
// densities, prefix masks and masks with holes, for every CPU implementation.
#include "kernels/pack.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Concat;
using testing::Rng;

struct Case {
  DType x_dtype;
  DType mask_dtype;
  int64_t B, S;
  std::vector<int64_t> tail;
  double density;
  MaskPattern kind;

  std::string ToString() const {
    return absl::StrCat("x ", DTypeName(x_dtype), " ",
                        ShapeString(Concat({B, S}, tail)), ", mask ",
                        DTypeName(mask_dtype), " ", MaskPatternName(kind),
                        " density ", density);
  }
};

#define EXPECT_SAME_BYTES(expected, actual) \
  EXPECT_TRUE(testing::SameBytes((expected), (actual)))

class PackTest : public ::testing::TestWithParam<std::string> {
 protected:
  // Packs x (and a second tensor, int64 token ids, sharing the mask) with
  // library-allocated and caller-provided outputs; scatters fresh random packed
  // rows back; compares all of it and the metadata with torch.
  void Check(const Case& c) {
    SCOPED_TRACE(c.ToString());
    Rng rng = Rng::Fresh();
    const at::Tensor mask =
        testing::RandomMask(rng, c.mask_dtype, c.B, c.S, c.density, c.kind);
    const std::vector<int64_t> dense_shape = Concat({c.B, c.S}, c.tail);
    const at::Tensor x = testing::RandomTensor(rng, c.x_dtype, dense_shape);
    const at::Tensor ids =
        testing::RandomTensor(rng, DType::kInt64, {c.B, c.S});
    const at::Tensor expected_x = testing::ReferencePack(x, mask);
    const at::Tensor expected_ids = testing::ReferencePack(ids, mask);
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(mask);

    const std::vector<TensorView> inputs = {AsView(x), AsView(ids)};
    PackOptions options;
    options.impl = GetParam();
    options.with_position_ids = true;
    absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->packed.size(), 2u);
    EXPECT_SAME_BYTES(expected_x, r->packed[0].view);
    EXPECT_SAME_BYTES(expected_ids, r->packed[1].view);
    EXPECT_EQ(r->cu_seqlens, meta.cu_seqlens);
    EXPECT_EQ(r->total_active, meta.total_active);
    EXPECT_EQ(r->max_seqlen, meta.max_seqlen);
    EXPECT_EQ(r->position_ids, meta.position_ids);
    EXPECT_EQ(r->last_index, meta.last_index);

    at::Tensor out_x = at::empty(expected_x.sizes(), x.options());
    at::Tensor out_ids = at::empty(expected_ids.sizes(), ids.options());
    testing::FillCanary(out_x);
    testing::FillCanary(out_ids);
    const std::vector<TensorView> outputs = {AsView(out_x), AsView(out_ids)};
    options.outputs = outputs;
    options.with_position_ids = false;
    absl::StatusOr<PackResult> into = Pack(inputs, AsView(mask), options);
    ASSERT_TRUE(into.ok()) << into.status();
    EXPECT_EQ(into->packed[0].view.data, out_x.data_ptr());
    EXPECT_SAME_BYTES(expected_x, AsView(out_x));
    EXPECT_SAME_BYTES(expected_ids, AsView(out_ids));
    EXPECT_TRUE(into->position_ids.empty());

    const at::Tensor packed = testing::RandomTensor(
        rng, c.x_dtype, Concat({meta.total_active}, c.tail));
    const at::Tensor expected_dense =
        testing::ReferenceScatter(packed, mask, dense_shape);
    const std::vector<TensorView> packed_views = {AsView(packed)};
    ScatterOptions scatter_options;
    scatter_options.impl = GetParam();
    scatter_options.tail_shape = Shape(c.tail.begin(), c.tail.end());
    absl::StatusOr<ScatterResult> s =
        Scatter(packed_views, AsView(mask), scatter_options);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_SAME_BYTES(expected_dense, s->dense[0].view);

    at::Tensor dense = at::empty(dense_shape, x.options());
    testing::FillCanary(dense);
    const std::vector<TensorView> dense_views = {AsView(dense)};
    scatter_options.outputs = dense_views;
    absl::StatusOr<ScatterResult> s_into =
        Scatter(packed_views, AsView(mask), scatter_options);
    ASSERT_TRUE(s_into.ok()) << s_into.status();
    EXPECT_SAME_BYTES(expected_dense, AsView(dense));
  }
};

TEST_P(PackTest, EveryDtypeOfXAndMask) {
  for (DType x_dtype : kAllDTypes) {
    for (DType mask_dtype : kAllDTypes) {
      Check({x_dtype, mask_dtype, 5, 37, {3}, 0.5, MaskPattern::kHoles});
      Check({x_dtype, mask_dtype, 3, 20, {}, 0.6, MaskPattern::kPrefix});
    }
  }
}

TEST_P(PackTest, ShapesTailsDensitiesAndMaskPatterns) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {0, 0}, {0, 5}, {3, 0}, {1, 1}, {2, 3}, {7, 13}, {3, 1031}, {1031, 3}};
  const std::vector<std::vector<int64_t>> tails = {{},     {1}, {3},
                                                   {2, 5}, {0}, {4096}};
  int i = 0;
  for (const auto& [B, S] : shapes) {
    for (const auto& tail : tails) {
      for (double density : {0.0, 0.1, 0.5, 1.0}) {
        for (MaskPattern kind : {MaskPattern::kPrefix, MaskPattern::kHoles}) {
          ++i;
          DType x_dtype = kAllDTypes[i % 10];
          // Keep the big-tail cases to a few MiB.
          if (!tail.empty() && tail[0] == 4096 && B * S > 64)
            x_dtype = DType::kUInt8;
          Check(
              {x_dtype, kAllDTypes[(i / 10) % 10], B, S, tail, density, kind});
        }
      }
    }
  }
}

// Sizes that split into several pieces across threads, through both CPU code
// paths: the typed loop (rows of 1 to 16 bytes under fragmented masks) and one
// copy per run.
TEST_P(PackTest, LargeMultiThreaded) {
  using P = MaskPattern;
  const DType bf16 = DType::kBFloat16, i64 = DType::kInt64, b = DType::kBool;
  const Case cases[] = {
      // clang-format off
      {i64,              b,               1024, 1031, {},    0.5, P::kHoles},
      {i64,              b,               64,   4096, {},    0.1, P::kHoles},
      {i64,              DType::kInt32,   64,   4096, {},    0.5, P::kPrefix},
      {DType::kFloat32,  b,               257,  1031, {4},   0.3, P::kHoles},
      {DType::kUInt8,    DType::kFloat16, 1024, 1031, {3},   0.5, P::kHoles},
      {bf16,             b,               16,   1024, {512}, 0.3, P::kHoles},
      {bf16,             b,               16,   1024, {512}, 0.3, P::kPrefix},
      {bf16,             b,               16,   1024, {512}, 1.0, P::kPrefix},
      {bf16,             b,               1,    9001, {128}, 0.9, P::kHoles},
      // clang-format on
  };
  for (const Case& c : cases) Check(c);
}

// The fast paths: all active is one contiguous copy, none active moves
// nothing.
TEST_P(PackTest, AllActiveAndNoneActiveFastPaths) {
  for (DType mask_dtype : {DType::kBool, DType::kFloat32, DType::kInt64}) {
    for (double density : {1.0, 0.0}) {
      Check({DType::kFloat32,
             mask_dtype,
             4,
             100,
             {2, 5},
             density,
             MaskPattern::kHoles});
    }
  }
}

TEST_P(PackTest, BackwardIsScatterOfTheGradient) {
  // grad_x = scatter(grad_packed): autograd through torch's x[mask] gives the
  // reference.
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kUInt8, 6, 50, 0.4, MaskPattern::kHoles);
  at::Tensor x = at::randn({6, 50, 7}, at::kDouble).set_requires_grad(true);
  at::Tensor packed = x.index({mask.ne(0)});
  const at::Tensor grad_packed = at::randn(packed.sizes(), at::kDouble);
  packed.backward(grad_packed);
  const std::vector<TensorView> grads = {AsView(grad_packed)};
  ScatterOptions options;
  options.impl = GetParam();
  absl::StatusOr<ScatterResult> s = Scatter(grads, AsView(mask), options);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_SAME_BYTES(x.grad(), s->dense[0].view);
}

TEST_P(PackTest, NanPayloadsAndSignsSurviveWithASingleActiveRow) {
  // 0xFFB7 is a negative bf16 NaN with a payload; torch's own index_put_ with a
  // single value would return the canonical 0x7FC0. Packing moves bits.
  const at::Tensor x =
      at::tensor({int16_t(0xFFB7), int16_t(0x7F81)}, at::kShort)
          .view(at::kBFloat16)
          .view({1, 2, 1});
  const at::Tensor mask = at::tensor({0, 1}, at::kByte).view({1, 2});
  PackOptions pack_options;
  pack_options.impl = GetParam();
  const std::vector<TensorView> inputs = {AsView(x)};
  absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), pack_options);
  ASSERT_TRUE(r.ok()) << r.status();
  uint16_t packed_bits = 0;
  std::memcpy(&packed_bits, r->packed[0].view.data, 2);
  EXPECT_EQ(packed_bits, 0x7F81);

  const at::Tensor one = at::tensor({int16_t(0xFFB7)}, at::kShort)
                             .view(at::kBFloat16)
                             .view({1, 1});
  const std::vector<TensorView> packed = {AsView(one)};
  ScatterOptions scatter_options;
  scatter_options.impl = GetParam();
  absl::StatusOr<ScatterResult> d =
      Scatter(packed, AsView(mask), scatter_options);
  ASSERT_TRUE(d.ok()) << d.status();
  uint16_t dense_bits[2] = {1, 1};
  std::memcpy(dense_bits, d->dense[0].view.data, 4);
  EXPECT_EQ(dense_bits[0], 0x0000);
  EXPECT_EQ(dense_bits[1], 0xFFB7);
  EXPECT_SAME_BYTES(testing::ReferenceScatter(one, mask, {1, 2, 1}),
                    d->dense[0].view);
}

INSTANTIATE_TEST_SUITE_P(Impl, PackTest, ::testing::Values("span", "torch"),
                         [](const auto& info) { return info.param; });

TEST(PackMetadata, HandChecked) {
  // Rows: two active then padding; empty; holes. Values 2, NaN and -0.0 test
  // "nonzero is active".
  const float nan = std::nanf("");
  at::Tensor mask = at::tensor({2.f, 1.f, 0.f, -0.f, 0.f, -0.f, 0.f, 0.f, 0.f,
                                nan, -0.f, 3.f})
                        .view({3, 4});
  at::Tensor x = at::arange(12, at::kInt).view({3, 4});
  const std::vector<TensorView> inputs = {AsView(x)};
  PackOptions options;
  options.with_position_ids = true;
  absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cu_seqlens, (std::vector<int64_t>{0, 2, 2, 4}));
  EXPECT_EQ(r->total_active, 4);
  EXPECT_EQ(r->max_seqlen, 2);
  EXPECT_EQ(r->position_ids, (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_EQ(r->last_index, (std::vector<int64_t>{1, -1, 3}));
  const int32_t* packed = static_cast<const int32_t*>(r->packed[0].view.data);
  EXPECT_EQ(std::vector<int32_t>(packed, packed + 4),
            (std::vector<int32_t>{0, 1, 9, 11}));
}

TEST(PackMetadata, LeftPaddedPositionsComeFromTheMask) {
  // Left padding: position ids restart at 0 at each row's first active token,
  // not at s.
  at::Tensor mask =
      at::tensor({0, 0, 1, 1, 1, 0, 1, 1, 1, 1}, at::kByte).view({2, 5});
  at::Tensor x = at::zeros({2, 5}, at::kFloat);
  const std::vector<TensorView> inputs = {AsView(x)};
  PackOptions options;
  options.with_position_ids = true;
  absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->position_ids, (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 3}));
  EXPECT_EQ(r->cu_seqlens, (std::vector<int64_t>{0, 3, 7}));
  EXPECT_EQ(r->last_index, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(r->max_seqlen, 4);
}

TEST(PackMetadata, EmptyBatch) {
  at::Tensor mask = at::zeros({0, 8}, at::kBool);
  at::Tensor x = at::zeros({0, 8, 3}, at::kFloat);
  const std::vector<TensorView> inputs = {AsView(x)};
  absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cu_seqlens, (std::vector<int64_t>{0}));
  EXPECT_EQ(r->max_seqlen, 0);
  EXPECT_TRUE(r->last_index.empty());
  EXPECT_EQ(r->packed[0].view.shape, (Shape{0, 3}));
}

TEST(Registry, BothImplementationsAreReachableAndAgree) {
  EXPECT_EQ(Registry::Global().Names(DeviceKind::kCpu),
            (std::vector<std::string>{"span", "torch"}));
  absl::StatusOr<Backend*> def = Registry::Get(Device::Cpu());
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ((*def)->name(), "span");
  absl::StatusOr<Backend*> torch = Registry::Get(Device::Cpu(), "torch");
  ASSERT_TRUE(torch.ok()) << torch.status();
  EXPECT_EQ((*torch)->name(), "torch");
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 1 + rng.Next() % 9, S = 1 + rng.Next() % 300;
    const DType dtype = kAllDTypes[rng.Next() % 10];
    const at::Tensor mask = testing::RandomMask(
        rng, kAllDTypes[rng.Next() % 10], B, S, rng.Uniform(),
        rng.Next() & 1 ? MaskPattern::kHoles : MaskPattern::kPrefix);
    const at::Tensor x =
        testing::RandomTensor(rng, dtype, {B, S, int64_t(rng.Next() % 5)});
    const std::vector<TensorView> inputs = {AsView(x)};
    PackOptions span, torch;
    torch.impl = "torch";
    absl::StatusOr<PackResult> a = Pack(inputs, AsView(mask), span);
    absl::StatusOr<PackResult> b = Pack(inputs, AsView(mask), torch);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(a->cu_seqlens, b->cu_seqlens);
    EXPECT_EQ(a->last_index, b->last_index);
    const at::Tensor b_packed = AsTensor(b->packed[0].view).clone();
    EXPECT_SAME_BYTES(b_packed, a->packed[0].view);
  }
}

// A test server runs every cpu call on torch (packd_testing --cpu_impl).
TEST(Registry, AnyBackendCanBeMadeTheDefault) {
  Registry& registry = Registry::Global();
  absl::StatusOr<Backend*> span = Registry::Get(Device::Cpu());
  ASSERT_TRUE(registry.MakeDefault(DeviceKind::kCpu, "torch").ok());
  EXPECT_EQ(registry.Names(DeviceKind::kCpu),
            (std::vector<std::string>{"torch", "span"}));
  absl::StatusOr<Backend*> def = Registry::Get(Device::Cpu());
  ASSERT_TRUE(def.ok());
  EXPECT_EQ((*def)->name(), "torch");
  EXPECT_EQ(*Registry::Get(Device::Cpu(), "span"), *span);  // still the same
  EXPECT_EQ(registry.MakeDefault(DeviceKind::kCpu, "nope").code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.MakeDefault(DeviceKind::kCpu, "span").ok());
  EXPECT_EQ(registry.Names(DeviceKind::kCpu),
            (std::vector<std::string>{"span", "torch"}));
}

}  // namespace
}  // namespace packd
