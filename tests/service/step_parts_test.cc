// The step's parts as plain functions (service/step_parts.h), each against a
// reference written here from its definition, on fresh random batches: the
// rows measured (documents, padding, CP and SP shares, costs, loss tokens),
// the micro-batches' tables (rows, bytes, places, ranks, the message limit),
// and PackSizes' bounds where its sums would overflow.
#include "service/step_parts.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "proto/plan_codec.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A [B, S] batch: prefix or holed masks, documents of 1 to 12 tokens, a loss
// mask active at about 80% of the mask's positions.
struct Batch {
  at::Tensor mask, ids, loss;

  static Batch Random(testing::Rng& rng, int64_t B, int64_t S) {
    Batch b;
    b.mask = testing::RandomMask(
        rng, DType::kBool, B, S, 0.6,
        rng.Next() % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix);
    b.ids = at::zeros({B, S}, at::kInt);
    int* ids = b.ids.data_ptr<int>();
    for (int64_t at = 0, id = 0; at < B * S; ++id) {
      const int64_t n = 1 + static_cast<int64_t>(rng.Next() % 12);
      for (int64_t k = at; k < std::min(at + n, B * S); ++k) {
        ids[k] = static_cast<int>(id);
      }
      at += n;
    }
    b.loss = b.mask & testing::RandomMask(rng, DType::kBool, B, S, 0.8,
                                          MaskPattern::kHoles);
    return b;
  }
};

// Each row's sequences by definition: its active positions cut wherever the
// id changes (every row starts one), or the whole row.
std::vector<std::vector<int64_t>> ReferenceSequences(const Batch& batch,
                                                     bool documents) {
  const int64_t B = batch.mask.size(0), S = batch.mask.size(1);
  const auto mask = batch.mask.accessor<bool, 2>();
  const auto ids = batch.ids.accessor<int, 2>();
  std::vector<std::vector<int64_t>> out(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t last_id = -1, active = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (!mask[b][s]) continue;
      ++active;
      if (documents && (out[b].empty() || ids[b][s] != last_id)) {
        out[b].push_back(0);
      }
      if (documents) ++out[b].back();
      last_id = ids[b][s];
    }
    if (!documents) out[b].push_back(active);
  }
  return out;
}

TEST(MeasureRows, MeasuresEveryRowAsTheLayoutLaysItOut) {
  testing::Rng rng = testing::Rng::Fresh();
  for (int round = 0; round < 12; ++round) {
    const Batch batch = Batch::Random(rng, 9, 70);
    const bool documents = round % 2 == 0;
    const bool with_loss = round % 3 != 0;
    LayoutOptions layout;
    layout.pad_multiple = std::vector<int64_t>{0, 8, 4, 6}[round % 4];
    if (round % 4 == 2) {
      layout.cp_size = 2;
      layout.cp_rank = 1;
    }
    if (round % 4 == 3) layout.sp_size = 4;
    const TensorView mask = AsView(batch.mask);
    const TensorView loss = AsView(batch.loss);
    const PackSizes sizes = PackSizes::Of({mask}, layout, {});
    PackOptions host;
    host.device = Device::Cpu();
    if (documents) host.segment_ids = AsView(batch.ids);
    absl::StatusOr<PackResult> counted =
        Pack({with_loss ? loss : mask}, mask, host);
    ASSERT_TRUE(counted.ok()) << counted.status();
    PlanOptions model;
    model.cost_per_token = 3;
    model.cost_per_token_squared = 0.5;
    const MeasuredRows measured = MeasureRows(
        *counted, with_loss ? std::optional<DType>(DType::kBool) : std::nullopt,
        documents, sizes, model);

    const auto sequences = ReferenceSequences(batch, documents);
    const int64_t m = std::max<int64_t>(layout.pad_multiple, 1);
    for (int64_t b = 0; b < 9; ++b) {
      SCOPED_TRACE(::testing::Message() << "round " << round << " row " << b);
      EXPECT_EQ(measured.rows[b].sequences, sequences[b]);
      int64_t padded = 0;
      double cost = 0;
      for (int64_t L : sequences[b]) {
        const int64_t P = (L + m - 1) / m * m;
        padded += P;
        cost += 3.0 * P + 0.5 * P * P;
      }
      const int64_t cp = std::max(layout.cp_size, 1);
      const int64_t sp = std::max(layout.sp_size, 1);
      EXPECT_EQ(measured.lengths[b], (padded / cp + sp - 1) / sp);
      EXPECT_DOUBLE_EQ(measured.costs[b], cost);
      const at::Tensor counted_row = with_loss ? batch.loss[b] : batch.mask[b];
      EXPECT_EQ(measured.loss_tokens[b], counted_row.sum().item<int64_t>());
      const at::Tensor active = batch.mask[b].nonzero();
      EXPECT_EQ(measured.extents[b],
                active.numel() == 0 ? 0 : active.max().item<int64_t>() + 1);
    }
  }
}

TEST(MeasureSharedRows, CostsEachSegmentOnItsRowAndCountsItsTargets) {
  testing::Rng rng = testing::Rng::Fresh();
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t B = 1 + rng.Next() % 7, S = 1 + rng.Next() % 24;
    const at::Tensor mask =
        testing::RandomMask(rng, DType::kBool, B, S, 0.7, MaskPattern::kPrefix);
    const at::Tensor loss =
        mask &
        testing::RandomMask(rng, DType::kBool, B, S, 0.7, MaskPattern::kHoles);
    std::vector<int64_t> active(B);
    for (int64_t b = 0; b < B; ++b) {
      active[b] = mask[b].sum().item<int64_t>();
    }
    // Rows in up to three groups, each group's prompt no longer than any of
    // its members' active tokens.
    SharedPrefix shared;
    std::vector<int64_t> group_prompt(3, S);
    for (int64_t b = 0; b < B; ++b) {
      shared.groups.push_back(static_cast<int64_t>(rng.Next() % 3));
      int64_t& p = group_prompt[shared.groups.back()];
      p = std::min(p, active[b]);
    }
    for (int64_t& p : group_prompt) p = p == 0 ? 0 : rng.Next() % (p + 1);
    for (int64_t b = 0; b < B; ++b) {
      shared.prefix_lengths.push_back(group_prompt[shared.groups[b]]);
    }
    LayoutOptions layout;
    layout.shared_prefix = shared;
    layout.max_rows = 1;  // the whole batch's stream is never sent
    const bool with_loss = trial % 2 == 0;
    PlanOptions model;
    model.cost_per_token = 1 + rng.Next() % 3;
    model.cost_per_token_squared = 0.25 * (rng.Next() % 3);
    PackOptions host;
    host.device = Device::Cpu();
    absl::StatusOr<PackResult> counted =
        Pack({AsView(with_loss ? loss : mask)}, AsView(mask), host);
    ASSERT_TRUE(counted.ok()) << counted.status();
    absl::StatusOr<MeasuredRows> measured = MeasureSharedRows(
        *counted, with_loss ? std::optional<DType>(DType::kBool) : std::nullopt,
        layout, model);
    ASSERT_TRUE(measured.ok()) << measured.status();
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    // By definition: a group's prompt is a segment of its first row (its
    // queries its keys), each member's response one of its own, whose keys
    // are the prompt and the response.
    std::vector<int64_t> lengths(B, 0), keys(B, 0), segments(B, 0);
    std::vector<double> costs(B, 0);
    std::vector<bool> seen(3, false);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = shared.prefix_lengths[b];
      if (!seen[shared.groups[b]] && p > 0) {
        lengths[b] += p;
        keys[b] += p;
        ++segments[b];
        costs[b] += SegmentCost(model, p, p);
      }
      seen[shared.groups[b]] = true;
      const int64_t r = active[b] - p;
      if (r > 0) {
        lengths[b] += r;
        keys[b] += p + r;
        ++segments[b];
        costs[b] += SegmentCost(model, r, p + r);
      }
    }
    ASSERT_EQ(measured->rows.size(), static_cast<size_t>(B));
    EXPECT_EQ(measured->lengths, lengths);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_DOUBLE_EQ(measured->costs[b], costs[b]) << "row " << b;
      EXPECT_EQ(measured->rows[b].keys, keys[b]) << "row " << b;
      EXPECT_EQ(measured->rows[b].segments, segments[b]) << "row " << b;
      // Its targets: active tokens from max(P, 1) on.
      const int64_t first =
          std::min(active[b], std::max<int64_t>(shared.prefix_lengths[b], 1));
      EXPECT_EQ(measured->rows[b].targets, active[b] - first);
      const at::Tensor counted_row =
          (with_loss ? loss : mask)[b].slice(0, first, active[b]);
      EXPECT_EQ(measured->loss_tokens[b], counted_row.sum().item<int64_t>());
      EXPECT_EQ(measured->extents[b], active[b]);
    }
  }
  // A prompt longer than a member's tokens: the layout's error, naming it.
  const at::Tensor mask = at::ones({2, 4}, at::kBool);
  PackOptions host;
  host.device = Device::Cpu();
  absl::StatusOr<PackResult> counted = Pack({AsView(mask)}, AsView(mask), host);
  ASSERT_TRUE(counted.ok());
  LayoutOptions layout;
  layout.shared_prefix = SharedPrefix{{0, 0}, {5, 5}, {}, false};
  EXPECT_EQ(MeasureSharedRows(*counted, std::nullopt, layout, PlanOptions{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A plan by hand: rank 0 gets rows {0, 1} then {2}, rank 1 gets {3}.
v1::PlanResponse HandPlan() {
  v1::PlanResponse plan;
  auto add = [&](int rank, std::vector<int64_t> samples, int64_t padded) {
    v1::MicroBatch* mb = plan.add_micro_batches();
    mb->set_rank(rank);
    for (int64_t s : samples) mb->add_samples(s);
    mb->set_padded_tokens(padded);
  };
  add(0, {0, 1}, 0);
  add(0, {2}, 0);
  add(1, {3}, 0);
  return plan;
}

TEST(PlaceMicroBatches, PlacesEachResultFromAMultipleOf64) {
  const std::vector<MeasuredRow> rows = {{{5, 3}}, {{7}}, {{1, 1, 1}}, {{16}}};
  LayoutOptions layout;
  layout.pad_multiple = 8;
  layout.shifts = {Shift{1, -100}};
  const at::Tensor x = at::zeros({4, 20, 3}, at::kBFloat16);
  const at::Tensor ids = at::zeros({4, 20}, at::kLong);
  const std::vector<TensorView> inputs = {AsView(x), AsView(ids)};
  const PackSizes sizes = PackSizes::Of(inputs, layout, {});
  const v1::PlanResponse plan = HandPlan();
  absl::StatusOr<MicroBatchTables> tables =
      PlaceMicroBatches(plan, {}, 2, rows, layout, sizes, inputs,
                        HostGather{10 * 20}, int64_t{1} << 30);
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->sent.size(), 3u);
  // Rows: every sequence padded to 8.
  const std::vector<int64_t> want_rows = {8 + 8 + 8, 24, 16};
  const std::vector<int> want_index = {0, 1, 0};
  int64_t at = 0;
  for (size_t k = 0; k < 3; ++k) {
    const MicroBatchPlace& p = tables->sent[k];
    EXPECT_EQ(p.micro_batch, &plan.micro_batches(static_cast<int>(k)));
    EXPECT_EQ(p.index, want_index[k]);
    EXPECT_EQ(p.rows, std::vector<int64_t>(3, want_rows[k]));
    EXPECT_EQ(p.bytes, (std::vector<int64_t>{want_rows[k] * 6, want_rows[k] * 8,
                                             want_rows[k] * 8}));
    for (size_t r = 0; r < 3; ++r) {
      at = (at + 63) / 64 * 64;
      EXPECT_EQ(p.offsets[r], at);
      at += p.bytes[r];
    }
  }
  EXPECT_EQ(tables->output_bytes, at);
  EXPECT_GT(tables->max_micro_batch_bytes, 2 * 20 * 10);

  // Rank 1 alone: its one micro-batch, placed from 0.
  const std::vector<int32_t> one = {1};
  tables = PlaceMicroBatches(plan, one, 2, rows, layout, sizes, inputs,
                             HostGather{10 * 20}, int64_t{1} << 30);
  ASSERT_TRUE(tables.ok());
  ASSERT_EQ(tables->sent.size(), 1u);
  EXPECT_EQ(tables->sent[0].micro_batch, &plan.micro_batches(2));
  EXPECT_EQ(tables->sent[0].offsets[0], 0);
}

TEST(PlaceMicroBatches, RefusesRanksFixedShapesAndMessagesByName) {
  const std::vector<MeasuredRow> rows = {{{5, 3}}, {{7}}, {{1, 1, 1}}, {{16}}};
  const at::Tensor x = at::zeros({4, 20, 3}, at::kFloat);
  const std::vector<TensorView> inputs = {AsView(x)};
  LayoutOptions layout;
  const PackSizes sizes = PackSizes::Of(inputs, layout, {});
  const v1::PlanResponse plan = HandPlan();
  auto place = [&](std::vector<int32_t> ranks, const LayoutOptions& l,
                   int64_t limit) {
    return PlaceMicroBatches(plan, ranks, 2, rows, l,
                             PackSizes::Of(inputs, l, {}), inputs,
                             HostGather{10 * 20}, limit)
        .status();
  };
  absl::Status s = place({2}, layout, 1 << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("ranks[0] is 2; the plan has ranks 0 .. 1"));
  s = place({1, 1}, layout, 1 << 30);
  EXPECT_THAT(s.message(), HasSubstr("ranks[1] repeats rank 1"));
  // Rank 1's micro-batch is one sequence and rank 0's second is three: a
  // fixed shape of two sequences holds the first, not the second.
  LayoutOptions fixed;
  fixed.fixed.sequences = 2;
  s = place({1}, fixed, 1 << 30);
  EXPECT_TRUE(s.ok()) << s;
  s = place({0}, fixed, 1 << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("micro-batch 0 of rank 0: fixed.sequences 2 "
                        "is less than the 3 sequences"));
  // 16 float rows of 3 take 192 bytes before any metadata.
  s = place({1}, layout, 200);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("micro-batch 0 of rank 1 would be about"));
  EXPECT_THAT(s.message(), HasSubstr("lower plan.max_tokens_per_micro_batch"));
  (void)sizes;
}

// The plan is chosen within one response: a message limit of M bytes holds at
// most M / 8 micro-batch slots, and a plan that needs more says which flag
// bounds it; the planner's own errors pass as they are.
TEST(PlanWithinMessage, BoundsTheSlotsByTheMessageLimit) {
  const std::vector<int64_t> lengths = {900, 300, 2048, 50, 700, 1200};
  PlanOptions options;
  options.max_tokens_per_micro_batch = 2048;
  options.num_ranks = 2;
  absl::StatusOr<Plan> fits = PlanWithinMessage(lengths, {}, options, 1 << 20);
  ASSERT_TRUE(fits.ok()) << fits.status();
  absl::StatusOr<Plan> alone = PlanMicroBatches(lengths, {}, options);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(fits->micro_batches_per_rank, alone->micro_batches_per_rank);
  EXPECT_EQ(fits->global_loss_tokens, 5198);
  const int64_t slots = 2 * fits->micro_batches_per_rank;

  // Exactly the slots the plan needs fit; one byte-slot fewer does not.
  EXPECT_TRUE(PlanWithinMessage(lengths, {}, options, 8 * slots).ok());
  absl::StatusOr<Plan> tight =
      PlanWithinMessage(lengths, {}, options, 8 * slots - 1);
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(tight.status().message(),
              HasSubstr("(one response holds no more: --max_message_bytes)"));

  options.max_tokens_per_micro_batch = 0;
  absl::StatusOr<Plan> bad = PlanWithinMessage(lengths, {}, options, 1 << 20);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), Not(HasSubstr("--max_message_bytes")));
}

// Every field packd fills or refuses itself is named, and a request without
// them passes.
TEST(CheckStepRequest, NamesEachFieldPackdMeasuresItself) {
  v1::PackMicroBatchesRequest ok;
  ok.mutable_plan()->set_max_tokens_per_micro_batch(64);
  ok.mutable_plan()->set_cost_per_token(24576);
  ok.mutable_plan()->set_cost_per_token_squared(1);
  EXPECT_TRUE(CheckStepRequest(ok).ok());
  const std::vector<
      std::pair<std::function<void(v1::PackMicroBatchesRequest*)>, const char*>>
      cases = {
          {[](auto* r) { r->mutable_plan()->add_lengths(3); },
           "plan.lengths must be empty"},
          {[](auto* r) { r->mutable_plan()->add_loss_tokens(3); },
           "plan.loss_tokens must be empty"},
          {[](auto* r) { r->mutable_plan()->add_costs(1.5); },
           "plan.costs must be empty"},
          {[](auto* r) { r->mutable_plan()->set_pad_multiple(8); },
           "plan.pad_multiple must be 0"},
          {[](auto* r) { r->mutable_plan()->set_cost_per_token(-1); },
           "plan.cost_per_token is -1"},
          {[](auto* r) {
             r->mutable_plan()->set_cost_per_token_squared(
                 std::numeric_limits<double>::infinity());
           },
           "plan.cost_per_token_squared is inf"},
          {[](auto* r) { r->mutable_batch()->add_outputs(); },
           "batch.outputs must be empty"},
      };
  for (const auto& [spoil, message] : cases) {
    v1::PackMicroBatchesRequest bad = ok;
    spoil(&bad);
    const absl::Status s = CheckStepRequest(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(s.message(), HasSubstr(message));
  }
}

// The rows planned as the step plans them: each row a sample whose loss
// tokens may pass its length (a CP rank's share), a shared prefix's groups
// its units, and errors saying they come from the batch's rows.
TEST(PlanStepRows, PlansEachRowAsASampleAndAGroupAsAUnit) {
  v1::PlanRequest measured;
  measured.set_max_tokens_per_micro_batch(120);
  measured.set_num_ranks(2);
  for (int64_t n : {60, 40, 30, 50}) measured.add_lengths(n);
  for (int64_t n : {120, 80, 60, 100}) measured.add_loss_tokens(n);  // CP 2
  absl::StatusOr<Plan> plan = PlanStepRows(measured, LayoutOptions{}, 1 << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->global_loss_tokens, 360);
  // The planner alone holds loss tokens to lengths.
  EXPECT_FALSE(PlanMicroBatches(LengthsOf(measured), LossTokensOf(measured),
                                PlanOptionsOf(measured))
                   .ok());

  LayoutOptions shared;
  shared.shared_prefix.emplace();
  shared.shared_prefix->groups = {5, 9, 9, 5};  // against the balance
  absl::StatusOr<Plan> grouped = PlanStepRows(measured, shared, 1 << 20);
  ASSERT_TRUE(grouped.ok()) << grouped.status();
  for (const MicroBatch& mb : grouped->micro_batches) {
    for (int64_t b : mb.samples) {
      const int64_t mate = 3 - b;  // the other row of its group
      EXPECT_THAT(mb.samples, ::testing::Contains(mate));
    }
  }

  measured.set_max_tokens_per_micro_batch(0);
  absl::StatusOr<Plan> bad = PlanStepRows(measured, LayoutOptions{}, 1 << 20);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("planning the batch's rows (each row one sample): "));
}

TEST(PackSizes, SaturatesWhereItsSumsWouldOverflow) {
  const int64_t top = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(SaturatingAdd(top - 1, 5), top);
  EXPECT_EQ(SaturatingMul(int64_t{1} << 40, int64_t{1} << 40), top);
  EXPECT_EQ(SaturatingMul(3, 5), 15);
  PackSizes sizes;
  sizes.pad_multiple = (int64_t{1} << 62) + 1;
  // One token padded to a multiple near int64's end: the multiple itself.
  EXPECT_EQ(sizes.PaddedRows(1), sizes.pad_multiple);
  sizes.pad_multiple = top - 1;
  EXPECT_EQ(sizes.PaddedRows(top - 2), top - 1);
  EXPECT_EQ(sizes.PaddedRows(top), top);  // two blocks: saturated
  sizes.pad_multiple = 1;
  sizes.cp_size = 2;
  sizes.sp_size = 3;
  // INT64_MAX / 2 is 3 * 1537228672809129301: shared out without rounding
  // up, and without a sum that overflows.
  EXPECT_EQ(sizes.RankRows(top), int64_t{1537228672809129301});
  EXPECT_EQ(sizes.RankRows(top - 2), int64_t{1537228672809129301});
  EXPECT_EQ(sizes.RankRows(12), 2);
  EXPECT_EQ(sizes.RankRows(14), 3);
}

}  // namespace
}  // namespace packd
