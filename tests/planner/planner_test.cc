// The planner's rules on random inputs (0 to 100,000 samples, 1 to 64 ranks,
// multiples 1 to 8, samples over the budget, zero lengths), its errors, and
// its quality against the peer (verl's planner) and the lower bound.
#include "planner/planner.h"

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "workloads/lengths.h"
#include "workloads/verl_planner.h"

namespace packd {
namespace {

using ::testing::HasSubstr;

std::mt19937_64 Fresh() {
  const uint64_t seed =
      std::chrono::steady_clock::now().time_since_epoch().count();
  std::cerr << "planner seed " << seed << "\n";
  return std::mt19937_64(seed);
}

// Lengths of RL rollouts: lognormal, clipped to [1, max].
TEST(Planner, KeepsEveryRuleOnRandomInputs) {
  std::mt19937_64 rng = Fresh();
  const std::vector<int64_t> sizes = {0, 1, 2, 3, 7, 64, 100, 1000, 5000};
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = sizes[trial % sizes.size()];
    PlanOptions options;
    options.num_ranks = static_cast<int32_t>(rng() % 65);  // 0 means 1
    options.micro_batch_multiple = static_cast<int32_t>(rng() % 9);
    options.max_tokens_per_micro_batch = 1 + rng() % 5000;
    std::vector<int64_t> lengths =
        UniformLengths(rng, n, 0, 6000);  // some over
    for (int64_t& v : lengths) {
      if (rng() % 10 == 0) v = 0;
    }
    std::vector<int64_t> loss;
    if (trial % 2) {
      for (int64_t v : lengths) loss.push_back(v == 0 ? 0 : rng() % (v + 1));
    }
    SCOPED_TRACE(::testing::Message()
                 << "n " << n << " ranks " << options.num_ranks << " multiple "
                 << options.micro_batch_multiple << " budget "
                 << options.max_tokens_per_micro_batch);
    absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, loss, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(CheckPlan(*plan, lengths, loss, options).ok())
        << CheckPlan(*plan, lengths, loss, options);
    int64_t expected_loss = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      expected_loss += loss.empty() ? lengths[i] : loss[i];
    }
    EXPECT_EQ(plan->global_loss_tokens, expected_loss);
    EXPECT_GE(plan->micro_batches_per_rank,
              MicroBatchLowerBound(lengths, options));
  }
}

TEST(Planner, OneHundredThousandSamples) {
  std::mt19937_64 rng = Fresh();
  PlanOptions options;
  options.num_ranks = 64;
  options.micro_batch_multiple = 4;
  options.max_tokens_per_micro_batch = 32768;
  const std::vector<int64_t> lengths =
      LognormalLengths(rng, 100000, 6.5, 1.0, 40000);
  absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(CheckPlan(*plan, lengths, {}, options).ok());
}

// Found by fuzz_plan: four samples over 48,575 ranks leave almost every
// micro-batch empty; filling them looked for a donor once per empty
// micro-batch over every rank (quadratic: over 10 s). Now linear.
TEST(Planner, FewSamplesOverVeryManyRanks) {
  PlanOptions options;
  options.max_tokens_per_micro_batch = 128;
  options.num_ranks = 48575;
  const std::vector<int64_t> lengths = {5, 5, 37, 8238};
  absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(CheckPlan(*plan, lengths, {}, options).ok());
  EXPECT_EQ(plan->micro_batches_per_rank, 1);
}

TEST(Planner, ASampleOverTheBudgetSitsAlone) {
  PlanOptions options;
  options.max_tokens_per_micro_batch = 100;
  options.num_ranks = 2;
  const std::vector<int64_t> lengths = {250, 30, 30, 30, 400, 10};
  absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(CheckPlan(*plan, lengths, {}, options).ok());
  for (const MicroBatch& mb : plan->micro_batches) {
    if (mb.tokens > 100) EXPECT_EQ(mb.samples.size(), 1u);
  }
}

TEST(Planner, BadInputsAreInvalidArgument) {
  PlanOptions options;
  options.max_tokens_per_micro_batch = 0;
  EXPECT_THAT(
      std::string(PlanMicroBatches({1}, {}, options).status().message()),
      HasSubstr("max_tokens_per_micro_batch must be positive"));
  options.max_tokens_per_micro_batch = 10;
  absl::Status s = PlanMicroBatches({1, -2}, {}, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("lengths[1] is -2"));
  s = PlanMicroBatches({1, 2}, {1}, options).status();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("loss_tokens has 1 entries but lengths has 2"));
  s = PlanMicroBatches({1, 2}, {1, 3}, options).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("loss_tokens[1] is 3"));
  options.num_ranks = -1;
  EXPECT_EQ(PlanMicroBatches({1}, {}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Planner, HugeBudgetsAndTotalsAreSafe) {
  // A budget near int64's limit over many ranks (fuzz_plan found the
  // capacity product overflowing) plans like a budget of the total.
  PlanOptions options;
  options.max_tokens_per_micro_batch = int64_t{0x3a3a3a3a3a3a3a3a};
  options.num_ranks = 379;
  const std::vector<int64_t> lengths = {7, 0, 1 << 20, 3};
  EXPECT_EQ(MicroBatchLowerBound(lengths, options), 1);
  absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(CheckPlan(*plan, lengths, {}, options).ok());
  EXPECT_EQ(plan->micro_batches_per_rank, 1);
  EXPECT_EQ(plan->global_loss_tokens, 7 + (1 << 20) + 3);
  plan = PlanMicroBatchesLikeVerl(lengths, {}, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(CheckPlan(*plan, lengths, {}, options).ok());
  options.max_tokens_per_micro_batch = std::numeric_limits<int64_t>::max();
  options.num_ranks = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(MicroBatchLowerBound({}, options), 1);

  // Sums past 2^53 would make the loss divisor inexact as a double.
  const int64_t half = int64_t{1} << 52;
  options.num_ranks = 2;
  ASSERT_TRUE(PlanMicroBatches({half, half}, {}, options).ok());
  absl::Status s = PlanMicroBatches({half, half, 1}, {}, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("passes 2^53 (9007199254740992) tokens at lengths[2]"));
  s = PlanMicroBatches({std::numeric_limits<int64_t>::max(), 1}, {}, options)
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

struct Workload {
  const char* name;
  std::vector<int64_t> lengths;
  PlanOptions options;
};

std::vector<Workload> Workloads(std::mt19937_64& rng) {
  std::vector<Workload> w;
  PlanOptions rl;
  rl.num_ranks = 8;
  rl.max_tokens_per_micro_batch = 16384;
  w.push_back({"1024 lognormal rollouts",
               LognormalLengths(rng, 1024, 6.8, 1.0, 8192), rl});
  w.push_back(
      {"bimodal 64-128 and 8000-8192", BimodalLengths(rng, 900, 124), rl});
  PlanOptions uni;
  uni.num_ranks = 16;
  uni.max_tokens_per_micro_batch = 8192;
  uni.micro_batch_multiple = 2;
  w.push_back({"4096 uniform 1-4096", UniformLengths(rng, 4096, 1, 4096), uni});
  return w;
}

// packd never needs more micro-batches per rank than the peer, never balances
// worse, and stays within the bound + one micro-batch (rounded to the
// multiple) at imbalance <= 1.01.
TEST(Planner, BeatsThePeerAndMeetsTheBound) {
  std::mt19937_64 rng = Fresh();
  for (int round = 0; round < 5; ++round) {
    for (const Workload& w : Workloads(rng)) {
      SCOPED_TRACE(w.name);
      absl::StatusOr<Plan> ours = PlanMicroBatches(w.lengths, {}, w.options);
      absl::StatusOr<Plan> peer =
          PlanMicroBatchesLikeVerl(w.lengths, {}, w.options);
      ASSERT_TRUE(ours.ok() && peer.ok());
      EXPECT_TRUE(CheckPlan(*peer, w.lengths, {}, w.options).ok())
          << CheckPlan(*peer, w.lengths, {}, w.options);
      EXPECT_LE(ours->micro_batches_per_rank, peer->micro_batches_per_rank);
      EXPECT_LE(ours->imbalance, peer->imbalance + 1e-9);
      const int64_t multiple = std::max(1, w.options.micro_batch_multiple);
      const int64_t bound = MicroBatchLowerBound(w.lengths, w.options);
      EXPECT_LE(ours->micro_batches_per_rank,
                (bound + 1 + multiple - 1) / multiple * multiple);
      EXPECT_LE(ours->imbalance, 1.01);
    }
  }
}

}  // namespace
}  // namespace packd
