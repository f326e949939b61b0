// Shared prompts (docs/design.md §14) against a reference written from the
// rules with torch: the stream (groups in the order of their first rows, each
// prompt once, then every member's response), its position ids and seq_idx,
// the attention metadata (segments, keys, kv_index), the targets and the
// shifted tensors in target space; Scatter in stream mode checked against
// torch autograd through the reference Pack, and in target mode against
// index_put; every error INVALID_ARGUMENT naming the field and the row or
// group, on both host backends.
#include "kernels/shared_prefix.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Bits;
using ::testing::HasSubstr;
using testing::Rng;

std::vector<int64_t> ActivePositions(const at::Tensor& mask, int64_t b) {
  const at::Tensor a = at::nonzero(mask[b].ne(0)).flatten().to(at::kLong);
  return std::vector<int64_t>(a.data_ptr<int64_t>(),
                              a.data_ptr<int64_t>() + a.numel());
}

// The reference stream: dense positions (b * S + s) of every stream row and
// target, and the metadata, from the rules alone.
struct Ref {
  std::vector<int64_t> rows, positions, seq_idx, targets;
  SharedLayout shared;
};

Ref ReferenceStream(const at::Tensor& mask, const SharedPrefix& sp) {
  const int64_t B = mask.size(0), S = mask.size(1);
  std::vector<int64_t> order;  // first rows, in order
  std::map<int64_t, std::vector<int64_t>> members;
  for (int64_t b = 0; b < B; ++b) {
    if (members[sp.groups[b]].empty()) order.push_back(b);
    members[sp.groups[b]].push_back(b);
  }
  Ref ref;
  SharedLayout& s = ref.shared;
  s.cu_seqlens_q = {0};
  s.cu_seqlens_k = {0};
  std::vector<int64_t> prompt_of(B), response_of(B);
  for (size_t g = 0; g < order.size(); ++g) {
    const int64_t f = order[g];
    const int64_t P = sp.prefix_lengths[f];
    const std::vector<int64_t> first = ActivePositions(mask, f);
    const int64_t prompt = ref.rows.size();
    for (int64_t i = 0; i < P; ++i) {
      ref.rows.push_back(f * S + first[i]);
      ref.positions.push_back(i);
      ref.seq_idx.push_back(g);
    }
    if (P > 0) {
      for (int64_t i = 0; i < P; ++i) s.kv_index.push_back(prompt + i);
      s.cu_seqlens_q.push_back(s.cu_seqlens_q.back() + P);
      s.cu_seqlens_k.push_back(s.cu_seqlens_k.back() + P);
      s.segment_row.push_back(f);
    }
    for (int64_t m : members[sp.groups[f]]) {
      const std::vector<int64_t> a = ActivePositions(mask, m);
      const int64_t start = ref.rows.size();
      prompt_of[m] = prompt;
      response_of[m] = start;
      const int64_t R = static_cast<int64_t>(a.size()) - P;
      for (int64_t i = 0; i < R; ++i) {
        ref.rows.push_back(m * S + a[P + i]);
        ref.positions.push_back(P + i);
        ref.seq_idx.push_back(g);
      }
      if (R > 0) {
        for (int64_t i = 0; i < P; ++i) s.kv_index.push_back(prompt + i);
        for (int64_t i = 0; i < R; ++i) s.kv_index.push_back(start + i);
        s.cu_seqlens_q.push_back(s.cu_seqlens_q.back() + R);
        s.cu_seqlens_k.push_back(s.cu_seqlens_k.back() + P + R);
        s.segment_row.push_back(m);
      }
    }
  }
  for (size_t n = 0; n + 1 < s.cu_seqlens_q.size(); ++n) {
    s.max_seqlen_q =
        std::max(s.max_seqlen_q, s.cu_seqlens_q[n + 1] - s.cu_seqlens_q[n]);
    s.max_seqlen_k =
        std::max(s.max_seqlen_k, s.cu_seqlens_k[n + 1] - s.cu_seqlens_k[n]);
  }
  s.target_cu_seqlens = {0};
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t> a = ActivePositions(mask, b);
    const int64_t P = sp.prefix_lengths[b];
    for (int64_t j = std::max<int64_t>(P, 1);
         j < static_cast<int64_t>(a.size()); ++j) {
      ref.targets.push_back(b * S + a[j]);
      s.pred_index.push_back(j - 1 < P ? prompt_of[b] + j - 1
                                       : response_of[b] + j - 1 - P);
    }
    s.target_cu_seqlens.push_back(ref.targets.size());
  }
  return ref;
}

// x's rows at dense positions `rows`, as [rows, *tail].
at::Tensor RowsOf(const at::Tensor& x, const std::vector<int64_t>& rows) {
  std::vector<int64_t> flat = {x.size(0) * x.size(1)};
  flat.insert(flat.end(), x.sizes().begin() + 2, x.sizes().end());
  const at::Tensor all = Bits(x).reshape(flat);
  return all.index_select(0, at::tensor(rows, at::kLong)).view(x.scalar_type());
}

TensorView View(const at::Tensor& t) { return AsView(t); }

// A random GRPO-like batch: rows in groups (interleaved), each group's prompt
// length at most its members' active tokens, the prompt rows of input 0 the
// same across each group.
struct Batch {
  at::Tensor mask, ids, x;
  SharedPrefix shared;
};

Batch RandomBatch(Rng& rng, int trial) {
  Batch batch;
  const int64_t B = 1 + rng.Next() % 9, S = 1 + rng.Next() % 20;
  batch.mask = testing::RandomMask(
      rng, kAllDTypes[trial % 10], B, S, 0.3 + 0.7 * rng.Uniform(),
      trial % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix);
  const int64_t groups = 1 + rng.Next() % B;
  std::vector<int64_t> shortest(groups, S);
  for (int64_t b = 0; b < B; ++b) {
    batch.shared.groups.push_back(static_cast<int64_t>(rng.Next() % groups) *
                                  7);  // ids need not be small or dense
  }
  const at::Tensor active = batch.mask.ne(0).sum(1).to(at::kLong);
  std::map<int64_t, int64_t> prefix;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = batch.shared.groups[b];
    const int64_t n = active[b].item<int64_t>();
    prefix[g] = prefix.count(g) ? std::min(prefix[g], n) : n;
  }
  for (auto& [g, p] : prefix) {
    p = rng.Next() % 4 == 0 ? 0 : static_cast<int64_t>(rng.Next() % (p + 1));
  }
  for (int64_t b = 0; b < B; ++b) {
    batch.shared.prefix_lengths.push_back(prefix[batch.shared.groups[b]]);
  }
  batch.ids = testing::RandomTensor(rng, DType::kInt64, {B, S});
  // Input 0's prompt rows copied from each group's first row.
  std::map<int64_t, int64_t> first;
  for (int64_t b = 0; b < B; ++b) first.emplace(batch.shared.groups[b], b);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = first[batch.shared.groups[b]];
    const std::vector<int64_t> from = ActivePositions(batch.mask, f);
    const std::vector<int64_t> to = ActivePositions(batch.mask, b);
    for (int64_t i = 0; i < batch.shared.prefix_lengths[b]; ++i) {
      batch.ids[b][to[i]] = batch.ids[f][from[i]];
    }
  }
  batch.shared.same_inputs = {0};
  batch.x = testing::RandomTensor(rng, kAllDTypes[(trial + 3) % 10],
                                  {B, S, 1 + static_cast<int64_t>(trial % 3)});
  return batch;
}

// r, the Pack of [batch.ids, batch.x] with shifts of both, holds the reference
// stream's rows, its targets' and its position ids.
void ExpectStream(const PackResult& r, const Batch& batch, const Ref& ref) {
  EXPECT_TRUE(
      testing::SameBytes(RowsOf(batch.ids, ref.rows), r.packed[0].view));
  EXPECT_TRUE(testing::SameBytes(RowsOf(batch.x, ref.rows), r.packed[1].view));
  EXPECT_TRUE(
      testing::SameBytes(RowsOf(batch.ids, ref.targets), r.shifted[0].view));
  EXPECT_TRUE(
      testing::SameBytes(RowsOf(batch.x, ref.targets), r.shifted[1].view));
  EXPECT_EQ(r.position_ids, ref.positions);
}

class SharedPrefixTest : public ::testing::TestWithParam<const char*> {
 protected:
  Rng rng_ = Rng::Fresh();
};

TEST_P(SharedPrefixTest, TheStreamTargetsAndMetadataAreTheRules) {
  for (int trial = 0; trial < 60; ++trial) {
    Batch batch = RandomBatch(rng_, trial);
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " B " << batch.mask.size(0) << " S "
                 << batch.mask.size(1));
    const Ref ref = ReferenceStream(batch.mask, batch.shared);
    PackOptions options;
    options.impl = GetParam();
    options.with_position_ids = true;
    options.layout.with_seq_idx = true;
    options.layout.shared_prefix = batch.shared;
    options.layout.shifts = {{0, -100}, {1, 0}};  // fills unused
    absl::StatusOr<PackResult> r =
        Pack({View(batch.ids), View(batch.x)}, View(batch.mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectStream(*r, batch, ref);
    EXPECT_EQ(r->seq_idx, ref.seq_idx);
    EXPECT_EQ(r->total_active, static_cast<int64_t>(ref.rows.size()));
    EXPECT_EQ(r->cu_seqlens, ref.shared.cu_seqlens_q);
    EXPECT_EQ(r->max_seqlen, ref.shared.max_seqlen_q);
    ASSERT_TRUE(r->shared.has_value());
    const SharedLayout& s = *r->shared;
    EXPECT_EQ(s.cu_seqlens_q, ref.shared.cu_seqlens_q);
    EXPECT_EQ(s.cu_seqlens_k, ref.shared.cu_seqlens_k);
    EXPECT_EQ(s.kv_index, ref.shared.kv_index);
    EXPECT_EQ(s.max_seqlen_q, ref.shared.max_seqlen_q);
    EXPECT_EQ(s.max_seqlen_k, ref.shared.max_seqlen_k);
    EXPECT_EQ(s.pred_index, ref.shared.pred_index);
    EXPECT_EQ(s.target_cu_seqlens, ref.shared.target_cu_seqlens);
    EXPECT_EQ(s.segment_row, ref.shared.segment_row);
    EXPECT_EQ(r->last_index, testing::ReferenceMetadata(batch.mask).last_index);

    // Scatter, stream mode: the gradient of that Pack (torch autograd through
    // the reference, float64 so that prompt rows' gradients are exact).
    const int64_t B = batch.mask.size(0), S = batch.mask.size(1);
    at::Tensor xd = at::randn({B, S, 3}, at::kDouble).requires_grad_();
    const at::Tensor picked =
        xd.reshape({B * S, 3}).index_select(0, at::tensor(ref.rows, at::kLong));
    const at::Tensor grad = at::randn(picked.sizes(), at::kDouble);
    picked.backward(grad);
    ScatterOptions back;
    back.impl = GetParam();
    back.layout.shared_prefix = batch.shared;
    absl::StatusOr<ScatterResult> dense =
        Scatter({View(grad)}, View(batch.mask), back);
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_TRUE(testing::SameBytes(xd.grad(), dense->dense[0].view));
    // Target mode: each target's row at its dense position.
    const at::Tensor per_target = testing::RandomTensor(
        rng_, DType::kFloat32, {static_cast<int64_t>(ref.targets.size()), 2});
    at::Tensor want = at::zeros({B * S, 2}, at::kInt);
    if (!ref.targets.empty()) {
      want.index_put_({at::tensor(ref.targets, at::kLong)}, Bits(per_target));
    }
    back.layout.shared_prefix->targets = true;
    dense = Scatter({View(per_target)}, View(batch.mask), back);
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_TRUE(testing::SameBytes(want.view(at::kFloat).view({B, S, 2}),
                                   dense->dense[0].view));
  }
}

// A group of one row is a plain row; prefix 0 makes every response its own
// segment; interleaved groups keep the order of their first rows.
TEST_P(SharedPrefixTest, WorkedCases) {
  const at::Tensor mask = at::ones({3, 4}, at::kBool);
  const at::Tensor ids =
      at::tensor({1, 2, 3, 4, 9, 9, 5, 6, 1, 2, 7, 8}, at::kLong).view({3, 4});
  PackOptions options;
  options.impl = GetParam();
  options.layout.shared_prefix = SharedPrefix{{0, 1, 0}, {2, 0, 2}, {0}};
  absl::StatusOr<PackResult> r = Pack({View(ids)}, View(mask), options);
  ASSERT_TRUE(r.ok()) << r.status();
  const int64_t* stream = static_cast<const int64_t*>(r->packed[0].view.data);
  // Group 0 (rows 0, 2): prompt 1 2, responses 3 4 and 7 8; group 1 (row 1,
  // prompt 0): its whole row as one response.
  EXPECT_THAT(std::vector<int64_t>(stream, stream + r->total_active),
              ::testing::ElementsAre(1, 2, 3, 4, 7, 8, 9, 9, 5, 6));
  EXPECT_THAT(r->shared->cu_seqlens_q, ::testing::ElementsAre(0, 2, 4, 6, 10));
  EXPECT_THAT(r->shared->cu_seqlens_k, ::testing::ElementsAre(0, 2, 6, 10, 14));
  EXPECT_THAT(r->shared->kv_index,
              ::testing::ElementsAre(0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9));
  EXPECT_THAT(r->shared->segment_row, ::testing::ElementsAre(0, 0, 2, 1));
  // Targets: rows 0 and 2 predict positions 2, 3 (from the prompt's last row
  // 1, then their own); row 1 predicts 1, 2, 3.
  EXPECT_THAT(r->shared->pred_index,
              ::testing::ElementsAre(1, 2, 6, 7, 8, 1, 4));
  EXPECT_THAT(r->shared->target_cu_seqlens, ::testing::ElementsAre(0, 2, 5, 7));
}

// Long prompts and responses under masks of long active blocks with gaps,
// so that the span backend gathers the stream by runs (each run of the
// stream crossing blocks of the mask), narrow and wide rows alike.
TEST_P(SharedPrefixTest, LongRowsOfBlocks) {
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t G = 1 + rng_.Next() % 4, groups = 1 + rng_.Next() % 5;
    const int64_t B = G * groups, S = 200 + rng_.Next() % 300;
    // Blocks of 40 to 120 positions, gaps of 0 to 9 between them.
    at::Tensor mask = at::zeros({B, S}, at::kBool);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = rng_.Next() % 10; s < S;) {
        const int64_t n = std::min<int64_t>(40 + rng_.Next() % 81, S - s);
        mask[b].narrow(0, s, n).fill_(true);
        s += n + rng_.Next() % 10;
      }
    }
    // Rows of a group interleaved with the others' (row b in group b % G).
    Batch batch;
    batch.mask = mask;
    const at::Tensor active = mask.sum(1).to(at::kLong);
    std::vector<int64_t> shortest(groups, S);
    for (int64_t b = 0; b < B; ++b) {
      batch.shared.groups.push_back(b % groups);
      shortest[b % groups] =
          std::min(shortest[b % groups], active[b].item<int64_t>());
    }
    for (int64_t b = 0; b < B; ++b) {
      batch.shared.prefix_lengths.push_back(shortest[b % groups] / 2 +
                                            trial % 3);
    }
    const DType narrow = trial % 2 ? DType::kInt64 : DType::kFloat32;
    batch.ids = testing::RandomTensor(rng_, narrow, {B, S});
    batch.x = testing::RandomTensor(rng_, DType::kFloat32, {B, S, 24});
    for (int64_t b = 0; b < B; ++b) {  // input 0's prompts equal
      const std::vector<int64_t> from = ActivePositions(mask, b % groups);
      const std::vector<int64_t> to = ActivePositions(mask, b);
      for (int64_t i = 0; i < batch.shared.prefix_lengths[b]; ++i) {
        batch.ids[b][to[i]] = batch.ids[b % groups][from[i]];
      }
    }
    batch.shared.same_inputs = {0};
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " B " << B << " S " << S);
    const Ref ref = ReferenceStream(mask, batch.shared);
    PackOptions options;
    options.impl = GetParam();
    options.with_position_ids = true;
    options.layout.shared_prefix = batch.shared;
    options.layout.shifts = {{0, 0}, {1, 0}};
    absl::StatusOr<PackResult> r =
        Pack({View(batch.ids), View(batch.x)}, View(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectStream(*r, batch, ref);
    EXPECT_EQ(r->shared->kv_index, ref.shared.kv_index);
    EXPECT_EQ(r->shared->pred_index, ref.shared.pred_index);
    // A prompt that differs in its last token is found, by group and row.
    if (G > 1 && batch.shared.prefix_lengths[0] > 0) {
      const int64_t member = groups;  // row `groups` is group 0's second row
      const int64_t last = batch.shared.prefix_lengths[member] - 1;
      const int64_t s = ActivePositions(mask, member)[last];
      Bits(batch.ids)[member][s].bitwise_xor_(1);  // one bit, any dtype
      r = Pack({View(batch.ids), View(batch.x)}, View(mask), options);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(r.status().message()),
                  HasSubstr(absl::StrCat("differs across group 0: row ", member,
                                         "'s prompt token ", last)));
    }
  }
}

// The span backend's gather by runs: random runs of packed tokens and pad
// runs, against the rows they name, for narrow and wide rows, under masks of
// long blocks (each run crossing several: copies by the mask's runs) and
// fragmented ones (narrow rows: each run compacted from its dense span).
TEST(GatherRuns, RunsOfPackedTokensAndPads) {
  Rng rng = Rng::Fresh();
  absl::StatusOr<Backend*> span = Registry::Get(Device::Cpu(), "span");
  ASSERT_TRUE(span.ok());
  absl::StatusOr<DeviceRuntime*> runtime = Registry::Runtime(Device::Cpu());
  ASSERT_TRUE(runtime.ok());
  absl::StatusOr<Stream> stream = (*runtime)->AcquireStream(Device::Cpu());
  ASSERT_TRUE(stream.ok());
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t B = 1 + rng.Next() % 6, S = 64 + rng.Next() % 400;
    at::Tensor mask;
    if (trial % 2 == 0) {
      mask = at::zeros({B, S}, at::kBool);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t s = rng.Next() % 5; s < S;) {
          // Blocks of 64 and more: runs long enough for the copies however
          // one is cut.
          const int64_t n = std::min<int64_t>(64 + rng.Next() % 96, S - s);
          mask[b].narrow(0, s, n).fill_(true);
          s += n + rng.Next() % 6;
        }
      }
    } else {
      mask =
          testing::RandomMask(rng, DType::kBool, B, S,
                              0.2 + 0.6 * rng.Uniform(), MaskPattern::kHoles);
    }
    const DType dtypes[] = {DType::kInt64, DType::kFloat32, DType::kBFloat16,
                            DType::kUInt8};
    const DType dtype = dtypes[trial / 2 % 4];
    const int64_t tail = trial % 3 == 0 ? 24 : 1;
    const at::Tensor x = testing::RandomTensor(rng, dtype, {B, S, tail});
    absl::StatusOr<std::unique_ptr<MaskPlan>> plan =
        (*span)->Plan(View(mask), *stream);
    ASSERT_TRUE(plan.ok());
    const int64_t total = (*plan)->total_active();
    const at::Tensor packed = Bits(testing::ReferencePack(x, mask));
    std::vector<TokenRun> runs;
    std::vector<int64_t> rows;  // packed token per output row, -1: pad
    for (int k = 0; k < 12 && total > 0; ++k) {
      if (rng.Next() % 5 == 0) {
        runs.push_back(TokenRun{-1, 1 + static_cast<int64_t>(rng.Next() % 7)});
      } else {
        const int64_t t = rng.Next() % total;
        runs.push_back(
            TokenRun{t, 1 + static_cast<int64_t>(rng.Next() % (total - t))});
      }
      for (int64_t i = 0; i < runs.back().count; ++i) {
        rows.push_back(runs.back().token < 0 ? -1 : runs.back().token + i);
      }
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    at::Tensor out = at::empty({n, tail}, x.options());
    const unsigned char pad[8] = {7, 0, 0, 0, 0, 0, 0, 0};
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    ASSERT_TRUE((*span)
                    ->GatherRuns(**plan, View(x), runs, pad, View(out), *stream)
                    .ok());
    at::Tensor want = at::full({n, tail}, 7, packed.options());
    for (int64_t j = 0; j < n; ++j) {
      if (rows[j] >= 0) want[j] = packed[rows[j]];
    }
    EXPECT_TRUE(at::equal(Bits(out), want));
  }
}

INSTANTIATE_TEST_SUITE_P(Impl, SharedPrefixTest,
                         ::testing::Values("span", "torch"),
                         [](const auto& info) { return info.param; });

TEST(SharedPrefix, EveryErrorIsInvalidArgumentNamingTheFieldAndRow) {
  const at::Tensor mask = at::ones({3, 4}, at::kBool);
  at::Tensor ids = at::arange(12, at::kLong).view({3, 4});
  auto pack = [&](SharedPrefix sp, PackOptions options = {}) {
    options.layout.shared_prefix = std::move(sp);
    absl::StatusOr<PackResult> r = Pack({View(ids)}, View(mask), options);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  EXPECT_THAT(pack({{0, 0}, {1, 1, 1}}),
              HasSubstr("shared_prefix.groups has 2 entries but the batch has "
                        "3 rows"));
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1}}),
              HasSubstr("shared_prefix.prefix_lengths has 2 entries"));
  EXPECT_THAT(pack({{0, 0, 1}, {1, -1, 1}}),
              HasSubstr("shared_prefix.prefix_lengths[1] is -1, below 0"));
  EXPECT_THAT(pack({{0, 0, 1}, {1, 2, 1}}),
              HasSubstr("shared_prefix.prefix_lengths[1] is 2 but row 0 of "
                        "the same group 0 has 1"));
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 5}}),
              HasSubstr("shared_prefix.prefix_lengths[2] is 5 but row 2 has 4 "
                        "active tokens"));
  EXPECT_THAT(pack({{0, 0, 1}, {2, 2, 1}, {3}}),
              HasSubstr("shared_prefix.same_inputs[0] is 3, which names no "
                        "input"));
  // Rows 0 and 1 of group 0 hold other prompts: named by group, row and
  // position.
  EXPECT_THAT(pack({{0, 0, 1}, {2, 2, 1}, {0}}),
              HasSubstr("inputs[0] differs across group 0: row 1's prompt "
                        "token 0 (of 2) is not row 0's"));
  ids[1][0] = 0;
  EXPECT_THAT(pack({{0, 0, 1}, {2, 2, 1}, {0}}),
              HasSubstr("row 1's prompt token 1 (of 2)"));
  PackOptions with;
  with.layout.pad_multiple = 4;
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 1}}, with),
              HasSubstr("shared_prefix with pad_multiple 4 is not defined"));
  with = {};
  with.layout.cp_size = 2;
  with.layout.pad_multiple = 4;
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 1}}, with), HasSubstr("is not defined"));
  with = {};
  with.layout.sp_size = 2;
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 1}}, with),
              HasSubstr("shared_prefix with sp_size 2 is not defined"));
  with = {};
  with.layout.fixed.tokens = 12;
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 1}}, with),
              HasSubstr("shared_prefix with fixed is not defined"));
  with = {};
  const at::Tensor segments = at::zeros({3, 4}, at::kInt);
  with.segment_ids = View(segments);
  EXPECT_THAT(pack({{0, 0, 1}, {1, 1, 1}}, with),
              HasSubstr("shared_prefix with segment_ids is not defined"));
  SharedPrefix targets{{0, 0, 1}, {1, 1, 1}};
  targets.targets = true;
  EXPECT_THAT(pack(targets), HasSubstr("shared_prefix.targets is Scatter's"));
  // Scatter: its rows must be the stream's, or with targets the targets'.
  ScatterOptions back;
  back.layout.shared_prefix = targets;
  absl::StatusOr<ScatterResult> s =
      Scatter({View(at::zeros({10, 2}))}, View(mask), back);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("has 10 rows but the shared stream has 9 targets"));
  back.layout.shared_prefix->targets = false;
  s = Scatter({View(at::zeros({9, 2}))}, View(mask), back);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("has 9 rows but the shared stream has 11 rows"));
}

}  // namespace
}  // namespace packd
