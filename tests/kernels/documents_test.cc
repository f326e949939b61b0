// Documents within rows (docs/design.md §8) against a plain reference
// written from the rules: the mask decides which tokens exist, segment ids
// only cut; an inactive position never starts or ends a document; every row
// starts one; position ids restart at every document.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::Rng;

struct Docs {
  std::vector<int64_t> cu, row, last, position_ids;
  int64_t max = 0;
  int64_t last_s = -1;
};

// The rules of section 8, position by position.
Docs ReferenceDocs(const at::Tensor& mask, const at::Tensor& ids) {
  const at::Tensor active = mask.ne(0).contiguous();
  const at::Tensor seg = ids.to(at::kLong).contiguous();
  const int64_t B = mask.size(0), S = mask.size(1);
  Docs d;
  int64_t k = 0;
  for (int64_t b = 0; b < B; ++b) {
    bool first = true;
    int64_t prev = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (!active[b][s].item<bool>()) continue;
      const int64_t id = seg[b][s].item<int64_t>();
      if (first || id != prev) {
        if (!d.cu.empty()) d.last.push_back(d.last_s);
        d.cu.push_back(k);
        d.row.push_back(b);
      }
      d.position_ids.push_back(k - d.cu.back());
      d.last_s = s;
      first = false;
      prev = id;
      ++k;
    }
  }
  if (!d.cu.empty()) d.last.push_back(d.last_s);
  d.cu.push_back(k);
  for (size_t i = 0; i + 1 < d.cu.size(); ++i) {
    d.max = std::max(d.max, d.cu[i + 1] - d.cu[i]);
  }
  return d;
}

enum class Ids { kRuns, kNoise, kMask, kNegative };

at::Tensor RandomIds(Rng& rng, DType dtype, const at::Tensor& mask, Ids kind) {
  const int64_t B = mask.size(0), S = mask.size(1);
  at::Tensor ids = at::zeros({B, S}, at::kLong);
  int64_t* p = ids.data_ptr<int64_t>();
  const int64_t hi =
      dtype == DType::kUInt8 || dtype == DType::kInt8 ? 100 : 30000;
  for (int64_t b = 0; b < B; ++b) {
    int64_t current = rng.Next() % hi;
    for (int64_t s = 0; s < S; ++s) {
      switch (kind) {
        case Ids::kRuns:
          if (rng.Next() % 40 == 0) current = rng.Next() % hi;
          p[b * S + s] = current;
          break;
        case Ids::kNoise:
          p[b * S + s] = rng.Next() % 3;
          break;
        case Ids::kMask:
          p[b * S + s] = mask[b][s].item<double>() != 0 ? 1 : 0;
          break;
        case Ids::kNegative:
          if (rng.Next() % 25 == 0)
            current = -static_cast<int64_t>(rng.Next() % hi);
          p[b * S + s] =
              dtype == DType::kUInt8 ? -current % 100 + 100 : current;
          break;
      }
    }
  }
  return ids.to(ToScalarType(dtype));
}

// Every field against the reference, and the packed bytes against torch.
void ExpectDocuments(const at::Tensor& x, const at::Tensor& mask,
                     const at::Tensor& ids) {
  const Docs want = ReferenceDocs(mask, ids);
  for (const char* impl : {"span", "torch"}) {
    SCOPED_TRACE(impl);
    PackOptions options;
    options.impl = impl;
    options.with_position_ids = true;
    options.segment_ids = AsView(ids);
    const std::vector<TensorView> inputs = {AsView(x), AsView(x)};
    absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->doc_cu_seqlens, want.cu);
    EXPECT_EQ(r->doc_row, want.row);
    EXPECT_EQ(r->doc_last_index, want.last);
    EXPECT_EQ(r->doc_max_seqlen, want.max);
    EXPECT_EQ(r->position_ids, want.position_ids);
    EXPECT_EQ(r->doc_cu_seqlens.back(), r->total_active);
    // Per row, as without segment ids.
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(mask);
    EXPECT_EQ(r->cu_seqlens, meta.cu_seqlens);
    EXPECT_EQ(r->last_index, meta.last_index);
    EXPECT_EQ(r->max_seqlen, meta.max_seqlen);
    EXPECT_TRUE(
        testing::SameBytes(testing::ReferencePack(x, mask), r->packed[1].view));
  }
}

TEST(Documents, RandomMasksAndIdsOfEveryIntegerDtype) {
  Rng rng = Rng::Fresh();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {0, 0}, {0, 7}, {3, 0}, {1, 1}, {4, 33}, {2, 1031}, {1031, 2}, {7, 300}};
  const DType dtypes[] = {DType::kUInt8, DType::kInt8, DType::kInt16,
                          DType::kInt32, DType::kInt64};
  int i = 0;
  for (const auto& [B, S] : shapes) {
    for (DType dtype : dtypes) {
      for (Ids kind : {Ids::kRuns, Ids::kNoise, Ids::kMask, Ids::kNegative}) {
        for (double density : {0.0, 0.4, 1.0}) {
          ++i;
          SCOPED_TRACE(::testing::Message()
                       << "[" << B << ", " << S << "] " << DTypeName(dtype)
                       << " ids kind " << static_cast<int>(kind) << " density "
                       << density);
          at::Tensor mask = testing::RandomMask(
              rng, kAllDTypes[i % 10], B, S, density,
              i % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix);
          if (i % 3 == 0 && S > 0)
            mask = mask.flip(1).contiguous();  // left pad
          const at::Tensor x =
              testing::RandomTensor(rng, DType::kFloat16, {B, S, 3});
          ExpectDocuments(x, mask, RandomIds(rng, dtype, mask, kind));
        }
      }
    }
  }
}

// A batch large enough that the cut runs in pieces of rows on several
// threads: the documents join across the pieces, also where the rows around
// a piece's first are empty (its first document's predecessor is further
// back).
TEST(Documents, ABatchCutInPiecesJoinsAcrossThem) {
  Rng rng = Rng::Fresh();
  const int64_t B = 64, S = 4096;
  int i = 0;
  for (DType dtype : {DType::kInt16, DType::kInt32, DType::kInt64}) {
    for (MaskPattern pattern : {MaskPattern::kHoles, MaskPattern::kPrefix}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " pattern "
                                        << static_cast<int>(pattern));
      at::Tensor mask =
          testing::RandomMask(rng, kAllDTypes[i++ % 10], B, S, 0.5, pattern);
      for (int64_t b = B / 2 - 3; b < B / 2 + 2; ++b) mask[b].zero_();
      const at::Tensor x = testing::RandomTensor(rng, DType::kInt32, {B, S});
      ExpectDocuments(x, mask, RandomIds(rng, dtype, mask, Ids::kRuns));
    }
  }
}

TEST(Documents, TheSeedsLengthsAndTheEdgeRules) {
  // One row holding documents of 1024, 32 and 32 tokens.
  at::Tensor ids =
      at::cat({at::full({1024}, 7, at::kInt), at::full({32}, 8, at::kInt),
               at::full({32}, 9, at::kInt)})
          .view({1, 1088});
  at::Tensor mask = at::ones({1, 1088}, at::kBool);
  at::Tensor x = at::arange(1088, at::kFloat).view({1, 1088, 1});
  PackOptions options;
  options.segment_ids = AsView(ids);
  options.with_position_ids = true;
  std::vector<TensorView> inputs = {AsView(x)};
  absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->doc_cu_seqlens, (std::vector<int64_t>{0, 1024, 1056, 1088}));
  EXPECT_EQ(r->doc_max_seqlen, 1024);
  EXPECT_EQ(r->doc_last_index, (std::vector<int64_t>{1023, 1055, 1087}));
  EXPECT_EQ(r->position_ids[1024], 0);
  EXPECT_EQ(r->position_ids[1023], 1023);

  // A hole inside a document keeps one document; a change of id at an
  // inactive position cuts nothing; the same id across a row boundary still
  // starts a new document in the next row.
  mask = at::tensor({1, 1, 0, 1, 1, 1, 0, 1}, at::kInt).view({2, 4});
  ids = at::tensor({5, 5, 9, 5, 5, 5, 3, 5}, at::kLong).view({2, 4});
  x = at::zeros({2, 4}, at::kInt);
  inputs = {AsView(x)};
  options.segment_ids = AsView(ids);
  r = Pack(inputs, AsView(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->doc_cu_seqlens, (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(r->doc_row, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(r->doc_last_index, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(r->position_ids, (std::vector<int64_t>{0, 1, 2, 0, 1, 2}));

  // Without segment ids nothing changes and the doc fields are empty.
  options.segment_ids.reset();
  r = Pack(inputs, AsView(mask), options);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->doc_cu_seqlens.empty());
  EXPECT_TRUE(r->doc_row.empty());
  EXPECT_EQ(r->doc_max_seqlen, 0);
}

TEST(Documents, WrongSegmentIdsAreInvalidArgumentAndNothingRuns) {
  const at::Tensor mask = at::ones({2, 4}, at::kBool);
  at::Tensor x = at::zeros({2, 4, 2}, at::kFloat);
  at::Tensor out = at::full({8, 2}, 3.0, at::kFloat);
  const std::vector<TensorView> inputs = {AsView(x)};
  const std::vector<TensorView> outputs = {AsView(out)};
  auto status = [&](const at::Tensor& ids) {
    PackOptions options;
    options.outputs = outputs;
    TensorView view = AsView(ids);
    options.segment_ids = view;
    return Pack(inputs, AsView(mask), options).status();
  };
  for (const at::Tensor& bad :
       {at::zeros({2, 4}, at::kFloat), at::zeros({2, 4}, at::kBool),
        at::zeros({2, 5}, at::kInt), at::zeros({2, 4, 1}, at::kInt)}) {
    const absl::Status s = status(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("segment_ids"));
  }
  PackOptions options;
  TensorView elsewhere = AsView(at::zeros({2, 4}, at::kInt));
  elsewhere.device = Device{DeviceKind::kCuda, 0};
  options.segment_ids = elsewhere;
  const absl::Status s = Pack(inputs, AsView(mask), options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("segment_ids is on cuda:0 but the mask is on cpu"));
  EXPECT_TRUE(at::equal(out, at::full({8, 2}, 3.0, at::kFloat)));
}

}  // namespace
}  // namespace packd
