// Layouts for parallel attention (docs/design.md §10) against a reference
// written from the rules with torch: padding to a multiple, cu_seqlens_padded,
// position ids through the padding, seq_idx, next-token shifts that stop at
// every sequence's end, fixed shapes with a trailing ghost, and context-
// parallel slices (each rank's two chunks of every sequence, as
// TransformerEngine's get_batch_on_this_cp_rank takes them). Scatter with a
// layout is checked against torch autograd through the reference Pack.
#include "kernels/layout.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Bits;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::Rng;

std::vector<int64_t> Vec(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

// The reference layout: per output row, the dense position it holds (-1:
// padding), the dense position its shifted rows hold (-1: fill), its position
// id and sequence; and the prefix arrays.
struct Ref {
  std::vector<int64_t> rows, shifted, position_ids, seq_idx;
  std::vector<int64_t> cu_real, cu_padded;
  int64_t max_real = 0, max_padded = 0;
};

Ref ReferenceLayout(const at::Tensor& mask, const at::Tensor& ids,
                    const LayoutOptions& o) {
  const int64_t B = mask.size(0), S = mask.size(1);
  const int64_t m = std::max<int64_t>(o.pad_multiple, 1);
  // The sequences, as lists of dense positions: rows, or documents cut where
  // the id changes between consecutive active tokens of a row.
  std::vector<std::vector<int64_t>> seqs;
  const at::Tensor active = mask.ne(0);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t> s = Vec(at::nonzero(active[b]).flatten());
    if (!ids.defined()) {
      seqs.emplace_back();
      for (int64_t p : s) seqs.back().push_back(b * S + p);
      continue;
    }
    const std::vector<int64_t> row_ids = Vec(ids[b]);
    for (size_t i = 0; i < s.size(); ++i) {
      if (i == 0 || row_ids[s[i]] != row_ids[s[i - 1]]) seqs.emplace_back();
      seqs.back().push_back(b * S + s[i]);
    }
  }
  Ref ref;
  ref.cu_real = {0};
  ref.cu_padded = {0};
  std::vector<at::Tensor> padded, shifted;
  for (const auto& seq : seqs) {
    const int64_t L = seq.size(), P = (L + m - 1) / m * m;
    std::vector<int64_t> r(P, -1), sh(P, -1);
    for (int64_t i = 0; i < L; ++i) r[i] = seq[i];
    for (int64_t i = 0; i + 1 < L; ++i) sh[i] = seq[i + 1];
    padded.push_back(at::tensor(r, at::kLong));
    shifted.push_back(at::tensor(sh, at::kLong));
    ref.cu_real.push_back(ref.cu_real.back() + L);
    ref.cu_padded.push_back(ref.cu_padded.back() + P);
    ref.max_real = std::max(ref.max_real, L);
    ref.max_padded = std::max(ref.max_padded, P);
  }
  // The trailing ghost: to fixed.tokens, or (SP) to a multiple of sp_size.
  const int64_t u = o.sp_size > 1 ? o.sp_size : 1;
  int64_t ghost =
      o.fixed.tokens > 0 ? o.fixed.tokens - ref.cu_padded.back() : 0;
  if (ghost == 0 && ref.cu_padded.back() % u != 0) {
    ghost = u - ref.cu_padded.back() % u;
  }
  if (ghost > 0) {
    padded.push_back(at::full({ghost}, -1, at::kLong));
    shifted.push_back(at::full({ghost}, -1, at::kLong));
    ref.cu_real.push_back(ref.cu_real.back());
    ref.cu_padded.push_back(ref.cu_padded.back() + ghost);
    ref.max_padded = std::max(ref.max_padded, ghost);
  }
  if (o.fixed.sequences > 0) {
    ref.cu_real.resize(o.fixed.sequences + 1, ref.cu_real.back());
    ref.cu_padded.resize(o.fixed.sequences + 1, ref.cu_padded.back());
  }
  if (o.fixed.max_seqlen > 0)
    ref.max_real = ref.max_padded = o.fixed.max_seqlen;
  // CP: each sequence's 2c chunks; rank r takes chunks r and 2c - 1 - r.
  const int64_t c = o.cp_size > 1 ? o.cp_size : 1;
  for (size_t k = 0; k < padded.size(); ++k) {
    const int64_t P = padded[k].numel();
    const at::Tensor positions = at::arange(P, at::kLong);
    auto take = [&](const at::Tensor& t) {
      if (c == 1) return t;
      const at::Tensor chunks = t.view({2 * c, P / (2 * c)});
      return at::cat({chunks[o.cp_rank], chunks[2 * c - 1 - o.cp_rank]});
    };
    for (int64_t v : Vec(take(padded[k]))) ref.rows.push_back(v);
    for (int64_t v : Vec(take(shifted[k]))) ref.shifted.push_back(v);
    for (int64_t v : Vec(take(positions))) ref.position_ids.push_back(v);
    for (int64_t i = 0; i < P / c; ++i) ref.seq_idx.push_back(k);
  }
  // SP: rank r's contiguous 1 / u of every per-row array.
  if (u > 1) {
    const int64_t n = static_cast<int64_t>(ref.rows.size()) / u;
    for (std::vector<int64_t>* v :
         {&ref.rows, &ref.shifted, &ref.position_ids, &ref.seq_idx}) {
      *v = std::vector<int64_t>(v->begin() + o.sp_rank * n,
                                v->begin() + (o.sp_rank + 1) * n);
    }
  }
  return ref;
}

// x's rows at `rows` (dense positions; -1: `pad` converted by torch to x's
// dtype), as [rows, *tail].
at::Tensor Gathered(const at::Tensor& x, const std::vector<int64_t>& rows,
                    double pad) {
  const int64_t B = x.size(0), S = x.size(1);
  std::vector<int64_t> tail(x.sizes().begin() + 2, x.sizes().end());
  std::vector<int64_t> flat_shape = {B * S};
  flat_shape.insert(flat_shape.end(), tail.begin(), tail.end());
  const at::Tensor flat = Bits(x).reshape(flat_shape);
  const at::Tensor index = at::tensor(rows, at::kLong);
  std::vector<int64_t> out_shape = {static_cast<int64_t>(rows.size())};
  out_shape.insert(out_shape.end(), tail.begin(), tail.end());
  at::Tensor out = flat.numel() > 0 ? flat.index_select(0, index.clamp_min(0))
                                    : at::empty(out_shape, flat.options());
  const at::Tensor pad_bits =
      Bits(at::scalar_tensor(pad, at::kDouble).to(x.scalar_type()).reshape({1}))
          .reshape({});
  std::vector<int64_t> bcast(out_shape.size(), 1);
  bcast[0] = rows.size();
  const at::Tensor is_pad = index.lt(0).view(bcast);
  out = at::where(is_pad, pad_bits, out);
  return out.view(x.scalar_type());
}

TensorView View(const at::Tensor& t) { return AsView(t); }

class LayoutTest : public ::testing::Test {
 protected:
  Rng rng_ = Rng::Fresh();
};

// TransformerEngine's worked case: two sequences of 8 tokens, cp 2; rank 0
// holds rows 0, 1, 6, 7, 8, 9, 14, 15 of the un-split layout.
TEST_F(LayoutTest, TransformerEnginesWorkedCase) {
  LayoutOptions o;
  o.pad_multiple = 4;
  o.cp_size = 2;
  o.cp_rank = 0;
  absl::StatusOr<Layout> rank0 = MakeLayout({0, 8, 16}, o);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  // As runs, a copy each: 0 1, then 6 7 8 9 (the end of one sequence and the
  // start of the next), then 14 15.
  ASSERT_EQ(rank0->source_runs.size(), 3u);
  EXPECT_EQ(rank0->source_runs[1].token, 6);
  EXPECT_EQ(rank0->source_runs[1].count, 4);
  rank0->ExpandRuns();
  EXPECT_THAT(rank0->source, ElementsAre(0, 1, 6, 7, 8, 9, 14, 15));
  EXPECT_THAT(rank0->position_ids, ElementsAre(0, 1, 6, 7, 0, 1, 6, 7));
  EXPECT_THAT(rank0->cu_seqlens_padded, ElementsAre(0, 8, 16));
  o.cp_rank = 1;
  absl::StatusOr<Layout> rank1 = MakeLayout({0, 8, 16}, o);
  ASSERT_TRUE(rank1.ok());
  rank1->ExpandRuns();
  EXPECT_THAT(rank1->source, ElementsAre(2, 3, 4, 5, 10, 11, 12, 13));
}

// Labels of a row of two documents stop at the boundary: the last token of
// each holds the fill, never the next document's first token.
TEST_F(LayoutTest, ShiftedLabelsStopAtEveryDocumentBoundary) {
  const at::Tensor mask = at::ones({1, 5}, at::kBool);
  const at::Tensor ids = at::tensor({7, 7, 7, 9, 9}, at::kInt).view({1, 5});
  const at::Tensor tokens =
      at::tensor({10, 11, 12, 20, 21}, at::kLong).view({1, 5, 1});
  PackOptions options;
  options.segment_ids = View(ids);
  options.layout.shifts = {{0, -100}};
  absl::StatusOr<PackResult> r = Pack({View(tokens)}, View(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->shifted.size(), 1u);
  const int64_t* labels = static_cast<const int64_t*>(r->shifted[0].view.data);
  EXPECT_THAT(std::vector<int64_t>(labels, labels + 5),
              ElementsAre(11, 12, -100, 21, -100));
}

TEST_F(LayoutTest, PackMatchesTheReferenceForEveryLayout) {
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t B = 1 + rng_.Next() % 5, S = 1 + rng_.Next() % 24;
    at::Tensor mask;
    switch (trial % 5) {
      case 0:
        mask = testing::RandomMask(rng_, DType::kFloat32, B, S, 0.6,
                                   MaskPattern::kPrefix);
        break;
      case 1:  // left-padded
        mask = testing::RandomMask(rng_, DType::kInt32, B, S, 0.6,
                                   MaskPattern::kPrefix)
                   .flip(1)
                   .contiguous();
        break;
      case 2:
        mask = testing::RandomMask(rng_, DType::kUInt8, B, S, 0.5,
                                   MaskPattern::kHoles);
        break;
      case 3:
        mask = at::ones({B, S}, at::kBool);
        break;
      default:
        mask = at::zeros({B, S}, at::kBool);
    }
    const bool docs = trial % 2 == 1;
    const at::Tensor ids =
        docs ? at::randint(0, 3, {B, S}, at::kShort) : at::Tensor();
    const DType dtype = kAllDTypes[trial % 10];
    const at::Tensor x = testing::RandomTensor(rng_, dtype, {B, S, 3});
    const at::Tensor tok = testing::RandomTensor(rng_, DType::kInt64, {B, S});
    LayoutOptions o;
    // CP on trials 1, 2, 3 (mod 4), SP on every seventh: they never combine.
    const int32_t c = 1 + trial % 4;
    const int32_t u = trial % 7 == 0 ? 2 + trial / 7 % 3 : 1;
    if (u > 1) {
      o.sp_size = u;
      o.sp_rank = static_cast<int32_t>(rng_.Next() % u);
      o.pad_multiple = rng_.Next() % 5;
    } else {
      o.cp_size = c;
      o.cp_rank = static_cast<int32_t>(rng_.Next() % c);
      o.pad_multiple = 2 * c * (1 + rng_.Next() % 3);
      if (c == 1) o.pad_multiple = 1 + rng_.Next() % 16;
    }
    o.with_seq_idx = true;
    o.shifts = {{1, -100}, {0, 1}};
    o.pad_values = {dtype == DType::kBool ? 1.0 : 3.0, -7, 0};
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " B " << B << " S " << S << " m "
                 << o.pad_multiple << " cp " << o.cp_size << "/" << o.cp_rank
                 << " sp " << o.sp_size << "/" << o.sp_rank << " "
                 << DTypeName(dtype) << (docs ? " docs" : ""));
    LayoutOptions unfixed_options = o;
    unfixed_options.sp_size = 0;
    unfixed_options.sp_rank = 0;
    const Ref un_fixed = ReferenceLayout(mask, ids, unfixed_options);
    if (trial % 3 == 0) {
      // A fixed shape, with a ghost when there is room: T - n a multiple of
      // the pad multiple m and (SP) T a multiple of u.
      const int64_t m = std::max<int64_t>(o.pad_multiple, 1);
      const int64_t n = un_fixed.cu_padded.back();
      for (int64_t k = trial % 2; k < trial % 2 + 8 * u; ++k) {
        if ((n + m * k) % u == 0) {
          o.fixed.tokens = n + m * k;
          break;
        }
      }
      o.fixed.sequences = static_cast<int64_t>(un_fixed.cu_real.size()) + 2;
      o.fixed.max_seqlen = o.fixed.tokens;
    }
    const Ref ref = ReferenceLayout(mask, ids, o);
    PackOptions options;
    options.layout = o;
    options.with_position_ids = true;
    options.with_token_mask = true;
    // Text only (no token is a vision one): each sequence's multimodal
    // positions are its position ids, in all three rows.
    options.mrope = MRopeOptions{};
    options.mrope->input = 2;
    options.mrope->image_token_id = std::numeric_limits<int64_t>::min();
    options.mrope->video_token_id = std::numeric_limits<int64_t>::min() + 1;
    // Both host implementations: the span backend's row copies and torch's
    // index ops.
    options.impl = trial / 2 % 2 == 0 ? "span" : "torch";
    if (docs) options.segment_ids = View(ids);
    absl::StatusOr<PackResult> r =
        Pack({View(x), View(tok.unsqueeze(2)), View(tok)}, View(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(testing::SameBytes(Gathered(x, ref.rows, o.pad_values[0]),
                                   r->packed[0].view));
    EXPECT_TRUE(testing::SameBytes(Gathered(tok.unsqueeze(2), ref.rows, -7),
                                   r->packed[1].view));
    EXPECT_TRUE(testing::SameBytes(
        Gathered(tok.unsqueeze(2), ref.shifted, -100), r->shifted[0].view));
    EXPECT_TRUE(
        testing::SameBytes(Gathered(x, ref.shifted, 1), r->shifted[1].view));
    // The padded array is returned whenever the layout reshapes.
    EXPECT_EQ(r->cu_seqlens_padded,
              o.reshapes() ? ref.cu_padded : std::vector<int64_t>{});
    EXPECT_EQ(r->max_seqlen_padded, o.reshapes() ? ref.max_padded : 0);
    EXPECT_EQ(docs ? r->doc_cu_seqlens : r->cu_seqlens, ref.cu_real);
    EXPECT_EQ(docs ? r->doc_max_seqlen : r->max_seqlen, ref.max_real);
    EXPECT_EQ(r->position_ids, ref.position_ids);
    EXPECT_EQ(r->seq_idx, ref.seq_idx);
    EXPECT_EQ(r->total_active, mask.ne(0).sum().item<int64_t>());
    std::string token_mask;
    for (int64_t row : ref.rows) token_mask.push_back(row >= 0 ? 1 : 0);
    EXPECT_EQ(r->token_mask, token_mask);
    std::vector<int64_t> three;
    for (int d = 0; d < 3; ++d) {
      three.insert(three.end(), ref.position_ids.begin(),
                   ref.position_ids.end());
    }
    EXPECT_EQ(r->mrope_position_ids, three);
  }
}

// Every rank's rows together are the un-split layout's, each exactly once.
TEST_F(LayoutTest, AllCpRanksTogetherHoldEveryRowOnce) {
  for (int32_t c = 2; c <= 4; ++c) {
    const std::vector<int64_t> starts = {0, 5, 5, 17, 40};
    LayoutOptions whole;
    whole.pad_multiple = 2 * c;
    absl::StatusOr<Layout> all = MakeLayout(starts, whole);
    ASSERT_TRUE(all.ok());
    std::multiset<int64_t> seen;
    int64_t rows = 0;
    for (int32_t r = 0; r < c; ++r) {
      LayoutOptions o = whole;
      o.cp_size = c;
      o.cp_rank = r;
      absl::StatusOr<Layout> rank = MakeLayout(starts, o);
      ASSERT_TRUE(rank.ok());
      rows += rank->rows();
      // Position ids identify a row within its sequence; seq ids which one.
      o.with_seq_idx = true;
      rank = MakeLayout(starts, o);
      for (int64_t j = 0; j < rank->rows(); ++j) {
        seen.insert(all->cu_seqlens_padded[rank->seq_idx[j]] +
                    rank->position_ids[j]);
      }
    }
    EXPECT_EQ(rows, all->rows());
    std::multiset<int64_t> want;
    for (int64_t j = 0; j < all->rows(); ++j) want.insert(j);
    EXPECT_EQ(seen, want) << "cp " << c;
  }
}

// Ulysses: the SP ranks' rows in rank order are the un-split layout padded to
// a multiple of sp_size by a trailing ghost (pad rows, positions from 0, the
// next seq_idx), which the prefix arrays and maxima count.
TEST_F(LayoutTest, SpRanksInRankOrderAreTheLayoutWithItsGhost) {
  const std::vector<int64_t> starts = {0, 5, 5, 12};
  for (int32_t u = 2; u <= 5; ++u) {
    for (int64_t m : {0, 1, 4}) {
      LayoutOptions whole;
      whole.pad_multiple = m;
      whole.with_seq_idx = true;
      whole.shifts = {{0, 0}};
      absl::StatusOr<Layout> all = MakeLayout(starts, whole);
      ASSERT_TRUE(all.ok());
      all->ExpandRuns();
      const int64_t n = m > 1 ? all->cu_seqlens_padded.back() : 12;
      const int64_t padded = (n + u - 1) / u * u;
      std::vector<int64_t> source, shifted, positions, seq_idx;
      for (int32_t r = 0; r < u; ++r) {
        LayoutOptions o = whole;
        o.sp_size = u;
        o.sp_rank = r;
        absl::StatusOr<Layout> rank = MakeLayout(starts, o);
        ASSERT_TRUE(rank.ok()) << rank.status();
        EXPECT_EQ(rank->rows(), padded / u);
        rank->ExpandRuns();
        source.insert(source.end(), rank->source.begin(), rank->source.end());
        shifted.insert(shifted.end(), rank->shifted_source.begin(),
                       rank->shifted_source.end());
        positions.insert(positions.end(), rank->position_ids.begin(),
                         rank->position_ids.end());
        seq_idx.insert(seq_idx.end(), rank->seq_idx.begin(),
                       rank->seq_idx.end());
        // Prefix arrays and maxima stay global, the ghost counted.
        std::vector<int64_t> cu_padded =
            m > 1 ? all->cu_seqlens_padded : std::vector<int64_t>{0, 5, 5, 12};
        std::vector<int64_t> cu_real = {0, 5, 5, 12};
        int64_t longest = m > 1 ? all->max_seqlen_padded : 7;
        if (padded > n) {
          cu_padded.push_back(padded);
          cu_real.push_back(12);
          longest = std::max(longest, padded - n);
        }
        EXPECT_EQ(rank->cu_seqlens_padded, cu_padded) << "u " << u;
        EXPECT_EQ(rank->cu_seqlens, cu_real) << "u " << u;
        EXPECT_EQ(rank->max_seqlen_padded, longest);
        EXPECT_EQ(rank->max_seqlen, 7);
      }
      std::vector<int64_t> want_source = all->source;
      std::vector<int64_t> want_shifted = all->shifted_source;
      std::vector<int64_t> want_positions = all->position_ids;
      std::vector<int64_t> want_seq_idx = all->seq_idx;
      for (int64_t i = 0; i < padded - n; ++i) {
        want_source.push_back(-1);
        want_shifted.push_back(-1);
        want_positions.push_back(i);
        want_seq_idx.push_back(3);
      }
      SCOPED_TRACE(::testing::Message() << "u " << u << " m " << m);
      EXPECT_EQ(source, want_source);
      EXPECT_EQ(shifted, want_shifted);
      EXPECT_EQ(positions, want_positions);
      EXPECT_EQ(seq_idx, want_seq_idx);
    }
  }
}

TEST_F(LayoutTest, ScatterIsTheGradientOfTheLayoutPack) {
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 1 + trial % 4, S = 3 + trial;
    const at::Tensor mask =
        testing::RandomMask(rng_, DType::kBool, B, S, 0.6, MaskPattern::kHoles);
    const bool docs = trial % 2 == 0;
    const at::Tensor ids =
        docs ? at::randint(0, 2, {B, S}, at::kInt) : at::Tensor();
    LayoutOptions o;
    if (trial % 5 == 4) {  // Ulysses
      o.sp_size = 2 + trial % 3;
      o.sp_rank = trial % o.sp_size;
      o.pad_multiple = trial % 3;
    } else {
      o.cp_size = 1 + trial % 3;
      o.cp_rank = trial % o.cp_size;
      o.pad_multiple = 2 * o.cp_size * (1 + trial % 2);
    }
    LayoutOptions unfixed = o;
    unfixed.sp_size = unfixed.sp_rank = 0;
    const Ref ref = ReferenceLayout(mask, ids, unfixed);
    if (trial % 4 == 1) {
      const int64_t m = std::max<int64_t>(o.pad_multiple, 1);
      const int64_t u = std::max<int32_t>(o.sp_size, 1);
      o.fixed.tokens = ref.cu_padded.back() + m;
      while (o.fixed.tokens % u != 0) o.fixed.tokens += m;
    }
    const Ref laid = ReferenceLayout(mask, ids, o);
    // torch autograd through the reference pack.
    at::Tensor x = at::randn({B, S, 2}, at::kDouble).requires_grad_();
    const at::Tensor index = at::tensor(laid.rows, at::kLong);
    const at::Tensor keep = index.ge(0).to(at::kDouble).unsqueeze(1);
    const at::Tensor packed =
        x.reshape({B * S, 2}).index_select(0, index.clamp_min(0)) * keep;
    const at::Tensor grad = at::randn(packed.sizes(), at::kDouble);
    packed.backward(grad);
    ScatterOptions options;
    options.layout = o;
    options.impl = trial % 3 == 0 ? "torch" : "span";
    if (docs) options.segment_ids = View(ids);
    absl::StatusOr<ScatterResult> r =
        Scatter({View(grad)}, View(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(testing::SameBytes(x.grad(), r->dense[0].view))
        << "trial " << trial;
  }
}

TEST_F(LayoutTest, EveryViolationIsInvalidArgumentNamingTheField) {
  const at::Tensor mask = at::ones({2, 6}, at::kBool);
  const at::Tensor x = at::zeros({2, 6, 4}, at::kFloat);
  const at::Tensor tok = at::zeros({2, 6}, at::kInt);
  auto error = [&](LayoutOptions o, bool with_tok = false) {
    PackOptions options;
    options.layout = std::move(o);
    std::vector<TensorView> inputs = {View(x)};
    if (with_tok) inputs.push_back(View(tok));
    absl::StatusOr<PackResult> r = Pack(inputs, View(mask), options);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  LayoutOptions o;
  o.pad_multiple = -1;
  EXPECT_THAT(error(o), HasSubstr("pad_multiple -1 is negative"));
  o = {};
  o.cp_size = -2;
  EXPECT_THAT(error(o), HasSubstr("cp_size -2 is negative"));
  o = {};
  o.fixed.tokens = -1;
  EXPECT_THAT(error(o), HasSubstr("fixed.tokens -1 is negative"));
  o = {};
  o.cp_size = 2;
  o.pad_multiple = 6;
  EXPECT_THAT(error(o),
              HasSubstr("pad_multiple 6 is not a multiple of 2 * cp_size = 4"));
  o.pad_multiple = 4;
  o.cp_rank = 2;
  EXPECT_THAT(error(o), HasSubstr("cp_rank 2 is not in [0, cp_size = 2)"));
  o = {};
  o.pad_values = {1, 2};
  EXPECT_THAT(error(o),
              HasSubstr("pad_values has 2 values but there are 1 inputs"));
  o = {};
  o.shifts = {{3, 0}};
  EXPECT_THAT(error(o), HasSubstr("shifts[0].input 3 names no input"));
  o = {};
  o.pad_values = {0, 1.5};
  EXPECT_THAT(error(o, true),
              HasSubstr("pad_values[1] 1.5 is not a value of int32"));
  o.pad_values = {0, 3e9};
  EXPECT_THAT(error(o, true),
              HasSubstr("pad_values[1] 3e+09 is not a value of int32"));
  o = {};
  o.shifts = {{1, 0.5}};
  EXPECT_THAT(error(o, true),
              HasSubstr("shifts[0].fill 0.5 is not a value of int32"));
  o = {};
  o.pad_multiple = 4;
  o.fixed.tokens = 6;
  EXPECT_THAT(error(o),
              HasSubstr("fixed.tokens 6 is less than the 16 padded tokens"));
  o.fixed.tokens = 18;
  EXPECT_THAT(error(o), HasSubstr("fixed.tokens 18 leaves 2 rows"));
  o.fixed.tokens = 20;
  o.fixed.sequences = 2;
  EXPECT_THAT(error(o),
              HasSubstr("fixed.sequences 2 is less than the 3 sequences"));
  o.fixed.sequences = 0;
  o.fixed.max_seqlen = 6;
  EXPECT_THAT(error(o), HasSubstr("fixed.max_seqlen 6 is less than 8"));
  o = {};
  o.sp_size = -1;
  EXPECT_THAT(error(o), HasSubstr("sp_size -1 is negative"));
  o.sp_size = 3;
  o.sp_rank = 3;
  EXPECT_THAT(error(o), HasSubstr("sp_rank 3 is not in [0, sp_size = 3)"));
  o = {};
  o.sp_rank = 1;
  EXPECT_THAT(error(o), HasSubstr("sp_rank 1 needs sp_size > 1"));
  o = {};
  o.sp_size = 2;
  o.cp_size = 2;
  o.pad_multiple = 4;
  EXPECT_THAT(error(o), HasSubstr("sp_size 2 and cp_size 2 are both set"));
  o = {};
  o.sp_size = 4;
  o.fixed.tokens = 14;
  EXPECT_THAT(error(o),
              HasSubstr("fixed.tokens 14 is not a multiple of sp_size 4"));
  o.fixed.tokens = 16;
  o.fixed.sequences = 2;
  EXPECT_THAT(error(o), HasSubstr("fixed.sequences 2 is less than the 3 "
                                  "sequences of this batch (its trailing "
                                  "ghost included)"));
  o = {};
  o.sp_size = 5;  // 12 rows, padded to 15 by a ghost of 3
  o.fixed.sequences = 2;
  EXPECT_THAT(error(o), HasSubstr("fixed.sequences 2 is less than the 3 "
                                  "sequences of this batch (its trailing "
                                  "ghost included)"));
  // Scatter takes only what places rows; its packed rows must be the layout's.
  ScatterOptions scatter;
  scatter.layout.pad_multiple = 4;
  absl::StatusOr<ScatterResult> s =
      Scatter({View(at::zeros({12, 4}, at::kFloat))}, View(mask), scatter);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("has 12 rows but the layout has 16 rows"));
  scatter.layout.shifts = {{0, 0}};
  s = Scatter({View(at::zeros({16, 4}, at::kFloat))}, View(mask), scatter);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("shifts and with_seq_idx are Pack's"));
}

// Each input is gathered as itself even where two share an address: two
// empty inputs (an empty micro-batch of a step, all ghost) and one memory
// viewed as two dtypes. Each result holds its own input's rows and pad value.
TEST_F(LayoutTest, InputsSharingAnAddressKeepTheirOwnRows) {
  PackOptions options;
  options.layout.fixed.tokens = 16;
  options.layout.pad_values = {-1.5, 7};
  const at::Tensor mask = at::zeros({0, 24}, at::kBool);
  const at::Tensor a = at::zeros({0, 24}, at::kBFloat16);
  const at::Tensor b = at::zeros({0, 24}, at::kByte);
  absl::StatusOr<PackResult> r = Pack({View(a), View(b)}, View(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(testing::SameBytes(at::full({16}, -1.5, at::kBFloat16),
                                 r->packed[0].view));
  EXPECT_TRUE(
      testing::SameBytes(at::full({16}, 7, at::kByte), r->packed[1].view));
  // One memory as int32 and as float32, with a shift of each.
  const at::Tensor m = at::ones({2, 5}, at::kBool);
  const at::Tensor ints = at::randint(0, 1 << 20, {2, 5}, at::kInt);
  const at::Tensor floats = ints.view(at::kFloat);
  options = {};
  options.layout.pad_multiple = 4;
  options.layout.pad_values = {-1, 0.5};
  options.layout.shifts = {{0, -100}, {1, 2.5}};
  r = Pack({View(ints), View(floats)}, View(m), options);
  ASSERT_TRUE(r.ok()) << r.status();
  LayoutOptions o = options.layout;
  const Ref ref = ReferenceLayout(m, at::Tensor(), o);
  EXPECT_TRUE(
      testing::SameBytes(Gathered(ints, ref.rows, -1), r->packed[0].view));
  EXPECT_TRUE(
      testing::SameBytes(Gathered(floats, ref.rows, 0.5), r->packed[1].view));
  EXPECT_TRUE(testing::SameBytes(Gathered(ints, ref.shifted, -100),
                                 r->shifted[0].view));
  EXPECT_TRUE(testing::SameBytes(Gathered(floats, ref.shifted, 2.5),
                                 r->shifted[1].view));
}

// Outputs a caller gives a layout Pack are the layout's results (one per
// input, then one per shift): of another count or shape, nothing is written.
TEST_F(LayoutTest, OutputsMustBeTheLayoutsResults) {
  const at::Tensor mask = at::ones({2, 6}, at::kBool);
  const at::Tensor x = at::randn({2, 6, 4});
  PackOptions options;
  options.layout.pad_multiple = 4;
  options.layout.shifts = {{0, 0}};
  at::Tensor right = at::full({16, 4}, 7.0), wrong = at::full({12, 4}, 7.0);
  std::vector<TensorView> one = {View(right)};
  options.outputs = one;
  absl::StatusOr<PackResult> r = Pack({View(x)}, View(mask), options);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("outputs has 1 entries but there are 2 results: give "
                        "one per input, then one per shift"));
  std::vector<TensorView> two = {View(right), View(wrong)};
  options.outputs = two;
  r = Pack({View(x)}, View(mask), options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(r.status().message()),
      HasSubstr("outputs[1].shape is [12, 4] but the result is [16, 4]"));
  EXPECT_TRUE(at::equal(right, at::full({16, 4}, 7.0)));
  at::Tensor shifted = at::full({16, 4}, 7.0);
  std::vector<TensorView> both = {View(right), View(shifted)};
  options.outputs = both;
  r = Pack({View(x)}, View(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(at::equal(right.narrow(0, 0, 6), x[0]));
  EXPECT_TRUE(at::equal(shifted.narrow(0, 0, 5), x[0].narrow(0, 1, 5)));
  EXPECT_TRUE(at::equal(shifted.narrow(0, 5, 3), at::zeros({3, 4})));
}

// A server bounds a layout's rows before anything is allocated for them: a
// huge pad_multiple, fixed.tokens or fixed.sequences is RESOURCE_EXHAUSTED.
TEST_F(LayoutTest, HugeLayoutsAreRefusedBeforeTheyAreAllocated) {
  LayoutOptions o;
  o.max_rows = 1 << 20;
  o.pad_multiple = int64_t{1} << 40;
  absl::StatusOr<Layout> l = MakeLayout({0, 3, 5}, o);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(l.status().message()),
              HasSubstr("more than the 1048576"));
  o.pad_multiple = 0;
  o.fixed.tokens = int64_t{1} << 50;
  EXPECT_EQ(MakeLayout({0, 3, 5}, o).status().code(),
            absl::StatusCode::kResourceExhausted);
  o.fixed.tokens = 0;
  o.fixed.sequences = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(MakeLayout({0, 3, 5}, o).status().code(),
            absl::StatusCode::kResourceExhausted);
  o.max_rows = 0;
  EXPECT_EQ(MakeLayout({0, 3, 5}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.pad_multiple = std::numeric_limits<int64_t>::max();
  o.fixed.sequences = 0;
  EXPECT_EQ(MakeLayout({0, 3, 5}, o).status().code(),
            absl::StatusCode::kInvalidArgument);  // overflow
}

TEST_F(LayoutTest, PadValuesAreConvertedAsTorchConvertsThem) {
  for (DType dtype : kAllDTypes) {
    for (double v :
         {0.0, -0.0, 1.0, 0.1, -3.75, 65519.0, 65520.0, 1e-8, 3.4e38, 1e300}) {
      absl::StatusOr<ElementBytes> bytes = ValueBytes(dtype, v, "pad");
      const at::Tensor want =
          at::scalar_tensor(v, at::kDouble).to(ToScalarType(dtype));
      if (!IsFloatingPoint(dtype) &&
          (v != std::trunc(v) || std::abs(v) > 1e9 ||
           (dtype == DType::kBool && v != 0 && v != 1) ||
           (dtype == DType::kUInt8 && (v < 0 || v > 255)) ||
           (dtype == DType::kInt8 && (v < -128 || v > 127)) ||
           (dtype == DType::kInt16 && std::abs(v) > 32767))) {
        EXPECT_FALSE(bytes.ok()) << DTypeName(dtype) << " " << v;
        continue;
      }
      ASSERT_TRUE(bytes.ok())
          << DTypeName(dtype) << " " << v << ": " << bytes.status();
      EXPECT_EQ(
          std::memcmp(bytes->data(), want.data_ptr(), want.element_size()), 0)
          << DTypeName(dtype) << " " << v;
    }
  }
}

}  // namespace
}  // namespace packd
