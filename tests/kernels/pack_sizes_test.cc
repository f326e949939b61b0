// PackSizes (kernels/pack_sizes.h), the one size model admission, a step's
// message checks and the layouts' row bounds read: on fresh random packs its
// result bytes equal what Pack returns and its row and metadata bounds hold
// what Pack returns; every sum saturates at int64's end instead of wrapping.
#include "kernels/pack_sizes.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Rng;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TensorView View(const at::Tensor& t) { return AsView(t); }

// Bytes of `v` as protobuf varints (a negative value takes 10).
int64_t VarintBytes(const std::vector<int64_t>& v) {
  int64_t bytes = 0;
  for (int64_t x : v) {
    uint64_t u = static_cast<uint64_t>(x);
    for (bytes += 1; u >= 128; u >>= 7) bytes += 1;
  }
  return bytes;
}

// What a response carries besides its tensors: every prefix array, index and
// per-row array as varints, the token mask's bytes and the maxima.
int64_t MetadataOf(const PackResult& r) {
  return VarintBytes(r.cu_seqlens) + VarintBytes(r.cu_seqlens_padded) +
         VarintBytes(r.last_index) + VarintBytes(r.position_ids) +
         VarintBytes(r.seq_idx) + VarintBytes(r.doc_cu_seqlens) +
         VarintBytes(r.doc_row) + VarintBytes(r.doc_last_index) +
         VarintBytes(r.mrope_position_ids) +
         static_cast<int64_t>(r.token_mask.size()) +
         VarintBytes({r.total_active, r.max_seqlen, r.doc_max_seqlen,
                      r.max_seqlen_padded});
}

int64_t ResultsOf(const PackResult& r) {
  int64_t bytes = 0;
  for (const ResultTensor& t : r.packed) bytes += t.view.nbytes();
  for (const ResultTensor& t : r.shifted) bytes += t.view.nbytes();
  return bytes;
}

TEST(PackSizesTest, ResultBytesEqualAndBoundsHoldPackOnRandomBatches) {
  Rng rng = Rng::Fresh();
  const DType dtypes[] = {DType::kBool,    DType::kInt8,     DType::kInt16,
                          DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                          DType::kInt64,   DType::kFloat64};
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t B = 1 + static_cast<int64_t>(rng.Next() % 6);
    // The first batch has long rows and position ids only, so that they take
    // varints of 3 bytes and the metadata bound is tight enough to fail.
    const int64_t S =
        trial == 0 ? 20000 : 1 + static_cast<int64_t>(rng.Next() % 40);
    const int64_t H = 1 + static_cast<int64_t>(rng.Next() % 5);
    const DType dtype = dtypes[rng.Next() % 8];
    const bool docs = trial % 2 == 1;
    const at::Tensor mask = testing::RandomMask(
        rng, DType::kBool, B, S, rng.Uniform(),
        trial % 3 ? MaskPattern::kHoles : MaskPattern::kPrefix);
    const at::Tensor x = testing::RandomTensor(rng, dtype, {B, S, H});
    const at::Tensor tok = testing::RandomTensor(rng, DType::kInt64, {B, S});
    at::Tensor ids = at::empty({B, S}, at::kInt);
    for (int64_t i = 0; i < B * S; ++i) {
      ids.data_ptr<int32_t>()[i] = static_cast<int32_t>(rng.Next() % 3);
    }
    PackOptions options;
    LayoutOptions& o = options.layout;
    o.pad_multiple = 1 + static_cast<int32_t>(rng.Next() % 4);
    if (trial % 5 == 2) {
      o.cp_size = 2;
      o.cp_rank = static_cast<int32_t>(rng.Next() % 2);
      o.pad_multiple = 4 * (1 + static_cast<int32_t>(rng.Next() % 2));
    }
    if (trial % 4 == 1) o.shifts = {{1, -100}, {0, 0}};
    o.with_seq_idx = trial != 0 && rng.Next() % 2 == 0;
    options.with_position_ids = trial == 0 || rng.Next() % 2 == 0;
    options.with_token_mask = trial != 0 && rng.Next() % 2 == 0;
    if (docs) options.segment_ids = View(ids);
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " B " << B << " S " << S << " "
                 << DTypeName(dtype) << " pad " << o.pad_multiple << " cp "
                 << o.cp_size << (docs ? " docs" : ""));
    const std::vector<TensorView> inputs = {View(x), View(tok)};
    absl::StatusOr<PackResult> r = Pack(inputs, View(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();

    const PackSizes sizes = PackSizes::Of(
        inputs, o, {options.with_position_ids, options.with_token_mask});
    const int64_t rows = r->packed[0].view.shape[0];
    const int64_t active = r->total_active;
    const int64_t sequences =
        docs ? static_cast<int64_t>(r->doc_row.size()) : B;
    EXPECT_EQ(sizes.ResultBytes(rows), ResultsOf(*r));
    EXPECT_EQ(sizes.ResultBytes(rows, rows), ResultsOf(*r));
    int64_t whole = x.nbytes() + tok.nbytes();
    for (const Shift& s : o.shifts)
      whole += s.input == 0 ? x.nbytes() : tok.nbytes();
    EXPECT_EQ(sizes.input_bytes, whole);
    EXPECT_EQ(sizes.ResultBytes(-1), whole);
    // The rows: at most the bound, exactly it without padding; the bound
    // over the most sequences admission can assume (one per active token
    // with documents) holds too.
    EXPECT_LE(rows, sizes.RankRows(sizes.MaxRows(active, sequences)));
    EXPECT_LE(rows, sizes.RankRows(sizes.MaxRows(active, docs ? active : B)));
    if (o.pad_multiple == 1) EXPECT_EQ(rows, sizes.MaxRows(active, sequences));
    EXPECT_LE(MetadataOf(*r), sizes.MetadataBytes(rows, B, sequences));
    EXPECT_LE(ResultsOf(*r) + MetadataOf(*r),
              sizes.MessageBytes(rows, rows, B, sequences, 0));
  }
}

TEST(PackSizesTest, EachResultTensorTakesItsRowsTimesItsRowBytes) {
  Rng rng = Rng::Fresh();
  const int64_t B = 3, S = 5, H = 1 + rng.Next() % 7;
  const at::Tensor x = at::zeros({B, S, H}, at::kBFloat16);
  const at::Tensor ids = at::zeros({B, S}, at::kLong);
  LayoutOptions layout;
  layout.shifts = {Shift{1, -100}, Shift{0, 0}, Shift{7, 0}};
  const PackSizes sizes = PackSizes::Of({View(x), View(ids)}, layout, {});
  // The inputs', then each shift's input's again; nothing for a shift naming
  // no input.
  EXPECT_EQ(sizes.result_row_bytes,
            (std::vector<int64_t>{2 * H, 8, 8, 2 * H, 0}));
  const int64_t rows = static_cast<int64_t>(rng.Next() % 1000);
  int64_t sum = 0;
  for (size_t r = 0; r < sizes.result_row_bytes.size(); ++r) {
    EXPECT_EQ(sizes.ResultTensorBytes(r, rows),
              rows * sizes.result_row_bytes[r]);
    sum += sizes.ResultTensorBytes(r, rows);
  }
  EXPECT_EQ(sum, sizes.ResultBytes(rows));
  EXPECT_EQ(sizes.ResultTensorBytes(0, std::numeric_limits<int64_t>::max()),
            std::numeric_limits<int64_t>::max());
}

TEST(PackSizesTest, PaddedAndRankRowsFollowTheirDefinitions) {
  PackSizes sizes;
  sizes.pad_multiple = 8;
  for (int64_t length = 0; length < 40; ++length) {
    EXPECT_EQ(sizes.PaddedRows(length), (length + 7) / 8 * 8) << length;
  }
  sizes.cp_size = 2;
  sizes.sp_size = 3;
  // 2 CP ranks of 48 rows: 24 each, over 3 SP ranks 8 each; 50 rows: 25, 9.
  EXPECT_EQ(sizes.RankRows(48), 8);
  EXPECT_EQ(sizes.RankRows(50), 9);
  sizes.fixed_tokens = 100;
  EXPECT_EQ(sizes.MaxRows(10, 5), 100);
  EXPECT_EQ(sizes.MaxRows(120, 5), 120);
  EXPECT_EQ(sizes.MaxRows(-1, 5), -1);
}

TEST(PackSizesTest, SumsSaturateAtInt64sEnd) {
  EXPECT_EQ(SaturatingMul(kMax / 2, 3), kMax);
  EXPECT_EQ(SaturatingMul(kMax / 2, 2), kMax / 2 * 2);
  EXPECT_EQ(SaturatingAdd(kMax, 1), kMax);
  EXPECT_EQ(SaturatingAdd(kMax - 1, 1), kMax);
  EXPECT_EQ(SaturatingMul(0, kMax), 0);

  // A header whose tail overflows: its position bytes and whole size stop
  // at the end, and so does every sum over them.
  const TensorView huge{nullptr, DType::kFloat64, {2, 3, kMax / 4, 5}};
  EXPECT_EQ(PositionBytes(huge), kMax);
  const PackSizes sizes = PackSizes::Of({huge}, LayoutOptions{}, {});
  EXPECT_EQ(sizes.row_bytes, kMax);
  EXPECT_EQ(sizes.input_bytes, kMax);
  EXPECT_EQ(sizes.ResultBytes(2), kMax);
  EXPECT_EQ(sizes.ResultBytes(-1), kMax);
  EXPECT_EQ(sizes.MessageBytes(kMax, kMax, kMax, kMax, kMax), kMax);
  EXPECT_EQ(ScatterResultBytes({TensorView{nullptr, DType::kInt32, {4, 8}}},
                               kMax / 8),
            kMax);

  // A pad multiple near the end: padded lengths and row bounds saturate.
  LayoutOptions layout;
  layout.pad_multiple = std::numeric_limits<int32_t>::max();
  PackSizes padded = PackSizes::Of({}, layout, {});
  padded.pad_multiple = int64_t{1} << 62;
  EXPECT_EQ(padded.PaddedRows((int64_t{1} << 62) + 1), kMax);  // 2 blocks
  EXPECT_EQ(padded.PaddedRows(int64_t{1} << 62), int64_t{1} << 62);
  EXPECT_EQ(padded.MaxRows(10, 3), kMax);
  EXPECT_EQ(padded.MetadataBytes(kMax / 2, kMax / 2, kMax / 2), kMax);
}

// What a step gathers on the host per row: S positions of the mask, the ids
// and the host inputs; an input on a device is gathered there.
TEST(PackSizesTest, HostGatherBytesCountTheMaskTheIdsAndHostInputsOnly) {
  const TensorView mask{nullptr, DType::kBool, {4, 9}};
  const TensorView ids{nullptr, DType::kInt32, {4, 9}};
  const TensorView hidden{nullptr, DType::kFloat32, {4, 9, 3, 2}};
  TensorView on_device{nullptr, DType::kFloat64, {4, 9, 7}};
  on_device.device.kind = DeviceKind::kCuda;
  EXPECT_EQ(HostGather::Of(mask, nullptr, {}).Bytes(3), 3 * 9);
  EXPECT_EQ(HostGather::Of(mask, &ids, {hidden}).Bytes(2),
            2 * 9 * (1 + 4 + 24));
  EXPECT_EQ(HostGather::Of(mask, &ids, {hidden, on_device}).Bytes(5),
            5 * 9 * (1 + 4 + 24));
  const TensorView huge{nullptr, DType::kFloat64, {2, 3, kMax / 4, 5}};
  EXPECT_EQ(HostGather::Of(mask, &ids, {hidden, huge}).row_bytes, kMax);
  EXPECT_EQ(HostGather::Of(mask, &ids, {hidden}).Bytes(kMax / 2), kMax);
}

}  // namespace
}  // namespace packd
