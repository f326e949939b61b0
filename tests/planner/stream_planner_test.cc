// The streamed plan (planner/stream_planner.h): every unit in exactly one
// micro-batch, every rank the same number of micro-batches, the budget kept,
// waves only when every rank's micro-batch is filled, the divisor the sum of
// every unit's loss tokens; and its quality: on the planner's workloads, under
// both cost models and in several arrival orders, the worst rank's cost within
// 5% of the whole-batch plan's wherever no unit costs more than a tenth of a
// rank's share (one that large arriving last cannot be balanced by what is
// still to come: within 40% there, and reported).
#include "planner/stream_planner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/planner/fresh_engine.h"
#include "workloads/lengths.h"
#include "workloads/plan_workloads.h"

namespace packd {
namespace {

using ::testing::HasSubstr;

std::mt19937_64 Fresh() { return testing::FreshEngine("stream planner"); }

struct Streamed {
  std::vector<Wave> waves;  // committed while units arrived, then the rest
  int64_t committed_before_close = 0;
  int64_t loss_tokens = 0;
  Plan plan;  // the planner's own account of the step's plan
};

// `under_filled_every`: after every that many units, an under-filled wave
// (as a step whose held rows fill its memory commits); 0: none.
Streamed Stream(const std::vector<StreamUnit>& units,
                const StreamPlanner::Options& options,
                size_t under_filled_every = 0) {
  absl::StatusOr<StreamPlanner> planner = StreamPlanner::Make(options);
  EXPECT_TRUE(planner.ok()) << planner.status();
  Streamed out;
  for (size_t i = 0; i < units.size(); ++i) {
    absl::StatusOr<std::vector<Wave>> waves = planner->Add(units[i]);
    EXPECT_TRUE(waves.ok()) << waves.status();
    for (Wave& w : *waves) out.waves.push_back(std::move(w));
    Wave forced;
    if (under_filled_every > 0 && (i + 1) % under_filled_every == 0 &&
        planner->CommitUnderFilled(&forced)) {
      out.waves.push_back(std::move(forced));
    }
  }
  out.committed_before_close = static_cast<int64_t>(out.waves.size());
  absl::StatusOr<std::vector<Wave>> rest = planner->Close();
  EXPECT_TRUE(rest.ok()) << rest.status();
  for (Wave& w : *rest) out.waves.push_back(std::move(w));
  out.loss_tokens = planner->loss_tokens();
  out.plan = planner->plan();
  return out;
}

// Every rule a streamed plan keeps, as a failure message ("" when kept).
std::string Broken(const Streamed& s, const std::vector<StreamUnit>& units,
                   const StreamPlanner::Options& options) {
  const int32_t R = std::max(options.plan.num_ranks, 1);
  const int64_t budget = options.plan.max_tokens_per_micro_batch;
  std::vector<int> seen(units.size(), 0);
  int64_t loss = 0;
  for (size_t w = 0; w < s.waves.size(); ++w) {
    const Wave& wave = s.waves[w];
    if (static_cast<int32_t>(wave.micro_batches.size()) != R) {
      return "a wave without one micro-batch per rank";
    }
    for (int32_t r = 0; r < R; ++r) {
      const MicroBatch& m = wave.micro_batches[r];
      if (m.rank != r) return "a micro-batch under another rank";
      int64_t tokens = 0;
      for (int64_t id : m.samples) {
        if (id < 0 || id >= static_cast<int64_t>(units.size())) {
          return "an unknown unit";
        }
        ++seen[id];
        tokens += units[id].length;
        loss += units[id].loss_tokens;
      }
      if (tokens != m.padded_tokens) return "padded tokens miscounted";
      if (tokens > budget && m.samples.size() > 1) return "budget passed";
      if (!std::is_sorted(m.samples.begin(), m.samples.end())) {
        return "samples not ascending";
      }
    }
  }
  for (int v : seen) {
    if (v != 1) return "a unit not in exactly one micro-batch";
  }
  const int64_t multiple = std::max(options.plan.micro_batch_multiple, 1);
  if (s.waves.size() % multiple != 0) return "micro-batches not a multiple";
  if (loss != s.loss_tokens) return "the divisor is not every unit's loss";
  // The plan: every wave's micro-batches, by rank then position.
  const Plan& plan = s.plan;
  if (plan.micro_batches_per_rank != static_cast<int64_t>(s.waves.size()) ||
      plan.micro_batches.size() != s.waves.size() * R ||
      plan.global_loss_tokens != s.loss_tokens) {
    return "the plan's counts differ from the waves'";
  }
  for (size_t k = 0; k < plan.micro_batches.size(); ++k) {
    const MicroBatch& want =
        s.waves[k % s.waves.size()].micro_batches[k / s.waves.size()];
    if (plan.micro_batches[k].samples != want.samples ||
        plan.micro_batches[k].rank != want.rank) {
      return "the plan's micro-batches are not the waves'";
    }
  }
  if (plan.imbalance < 1.0 - 1e-12 || plan.cost_imbalance < 1.0 - 1e-12) {
    return "an imbalance below 1";
  }
  return "";
}

std::vector<StreamUnit> Units(const std::vector<int64_t>& lengths,
                              const PlanOptions& model, std::mt19937_64& rng) {
  std::vector<StreamUnit> units;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t pad = std::max<int64_t>(model.pad_multiple, 1);
    const int64_t padded = (lengths[i] + pad - 1) / pad * pad;
    units.push_back(
        {static_cast<int64_t>(i), padded,
         lengths[i] == 0 ? 0 : static_cast<int64_t>(rng() % (lengths[i] + 1)),
         SequenceCost(model, padded)});
  }
  return units;
}

TEST(StreamPlanner, KeepsEveryRuleOnRandomInputs) {
  std::mt19937_64 rng = Fresh();
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = std::vector<int64_t>{0, 1, 5, 40, 300, 2000}[trial % 6];
    StreamPlanner::Options options;
    options.plan.num_ranks = static_cast<int32_t>(rng() % 17);
    options.plan.micro_batch_multiple = static_cast<int32_t>(rng() % 4);
    options.plan.max_tokens_per_micro_batch = 1 + rng() % 8000;
    options.fill = 0.5 + 0.5 * (rng() % 100) / 100.0 + 0.001;
    options.fill = std::min(options.fill, 1.0);
    options.reserve = (rng() % 4) / 2.0;
    std::vector<int64_t> lengths = UniformLengths(rng, n, 0, 6000);
    PlanOptions model;
    model.cost_per_token = rng() % 2 ? 24576 : 0;
    model.cost_per_token_squared = 1;
    const std::vector<StreamUnit> units = Units(lengths, model, rng);
    SCOPED_TRACE(::testing::Message()
                 << "n " << n << " ranks " << options.plan.num_ranks
                 << " budget " << options.plan.max_tokens_per_micro_batch
                 << " fill " << options.fill);
    const Streamed s = Stream(units, options);
    EXPECT_EQ(Broken(s, units, options), "");
  }
}

TEST(StreamPlanner, UnderFilledWavesKeepEveryRule) {
  std::mt19937_64 rng = Fresh();
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t n = std::vector<int64_t>{1, 5, 40, 300}[trial % 4];
    StreamPlanner::Options options;
    options.plan.num_ranks = 1 + static_cast<int32_t>(rng() % 8);
    options.plan.micro_batch_multiple = static_cast<int32_t>(rng() % 3);
    options.plan.max_tokens_per_micro_batch = 1 + rng() % 8000;
    options.reserve = (rng() % 4) / 2.0;
    std::vector<int64_t> lengths = UniformLengths(rng, n, 0, 6000);
    PlanOptions model;
    model.cost_per_token_squared = 1;
    const std::vector<StreamUnit> units = Units(lengths, model, rng);
    SCOPED_TRACE(::testing::Message()
                 << "n " << n << " ranks " << options.plan.num_ranks
                 << " budget " << options.plan.max_tokens_per_micro_batch);
    const Streamed s = Stream(units, options, 1 + rng() % 7);
    EXPECT_EQ(Broken(s, units, options), "");
  }
}

// Two ranks, micro-batches of 100 tokens that a wave fills to 90.
absl::StatusOr<StreamPlanner> TwoRanksOf100(double reserve) {
  StreamPlanner::Options options;
  options.plan.num_ranks = 2;
  options.plan.max_tokens_per_micro_batch = 100;
  options.fill = 0.9;
  options.reserve = reserve;
  return StreamPlanner::Make(options);
}

TEST(StreamPlanner, AnUnderFilledWaveTakesWhatThePoolHoldsUnderTheBudget) {
  absl::StatusOr<StreamPlanner> planner = TwoRanksOf100(/*reserve=*/1);
  ASSERT_TRUE(planner.ok());
  Wave wave;
  EXPECT_FALSE(planner->CommitUnderFilled(&wave)) << "an empty pool";
  // Rows of 60 and 44: no two fill a micro-batch to 90, so no wave commits
  // however many arrive (and the reserve holds back two micro-batches more).
  for (int64_t id = 0; id < 6; ++id) {
    const int64_t len = id % 2 ? 44 : 60;
    absl::StatusOr<std::vector<Wave>> waves =
        planner->Add({id, len, len, static_cast<double>(len)});
    ASSERT_TRUE(waves.ok());
    EXPECT_TRUE(waves->empty()) << id;
  }
  ASSERT_TRUE(planner->CommitUnderFilled(&wave));
  ASSERT_EQ(wave.micro_batches.size(), 2u);
  int64_t placed = 0;
  for (const MicroBatch& m : wave.micro_batches) {
    EXPECT_LE(m.padded_tokens, 100);
    EXPECT_GT(m.padded_tokens, 0) << "every rank gets rows";
    placed += static_cast<int64_t>(m.samples.size());
  }
  EXPECT_EQ(planner->pending(), 6u - static_cast<size_t>(placed));
  EXPECT_EQ(planner->waves(), 1);
  absl::StatusOr<std::vector<Wave>> rest = planner->Close();
  ASSERT_TRUE(rest.ok());
  EXPECT_FALSE(planner->CommitUnderFilled(&wave)) << "after the close";
}

TEST(StreamPlanner, CommitsAWaveOnlyOnceEveryRankIsFilled) {
  absl::StatusOr<StreamPlanner> planner = TwoRanksOf100(/*reserve=*/0);
  ASSERT_TRUE(planner.ok());
  // 95, then 50 + 30 on the other rank: one filled, the other short of 90
  // and behind it (costs are lengths), until the fourth unit.
  for (int64_t len : {95, 50, 30}) {
    absl::StatusOr<std::vector<Wave>> waves =
        planner->Add({len, len, len, static_cast<double>(len)});
    ASSERT_TRUE(waves.ok());
    EXPECT_TRUE(waves->empty()) << len;
  }
  absl::StatusOr<std::vector<Wave>> waves = planner->Add({10, 10, 10, 10.0});
  ASSERT_TRUE(waves.ok());
  ASSERT_EQ(waves->size(), 1u);
  const Wave& w = (*waves)[0];
  EXPECT_EQ(w.micro_batches[0].padded_tokens + w.micro_batches[1].padded_tokens,
            185);
  EXPECT_EQ(planner->pending(), 0u);
  EXPECT_EQ(planner->waves(), 1);
  // Nothing left: the close adds nothing, and the ranks stay even.
  absl::StatusOr<std::vector<Wave>> rest = planner->Close();
  ASSERT_TRUE(rest.ok());
  EXPECT_TRUE(rest->empty());
}

TEST(StreamPlanner, ClosesWithAnEmptyMicroBatchForARankWithNothingLeft) {
  StreamPlanner::Options options;
  options.plan.num_ranks = 4;
  options.plan.max_tokens_per_micro_batch = 1000;
  absl::StatusOr<StreamPlanner> planner = StreamPlanner::Make(options);
  ASSERT_TRUE(planner.ok());
  ASSERT_TRUE(planner->Add({7, 10, 10, 10}).ok());
  absl::StatusOr<std::vector<Wave>> rest = planner->Close();
  ASSERT_TRUE(rest.ok()) << rest.status();
  ASSERT_EQ(rest->size(), 1u);
  int empty = 0;
  for (const MicroBatch& m : (*rest)[0].micro_batches)
    empty += m.samples.empty();
  EXPECT_EQ(empty, 3);
  EXPECT_EQ(planner->loss_tokens(), 10);
}

TEST(StreamPlanner, RefusesBadOptionsAndUnits) {
  StreamPlanner::Options options;
  EXPECT_THAT(StreamPlanner::Make(options).status().message(),
              HasSubstr("max_tokens_per_micro_batch is 0"));
  options.plan.max_tokens_per_micro_batch = 10;
  options.fill = 0;
  EXPECT_THAT(StreamPlanner::Make(options).status().message(),
              HasSubstr("fill is 0"));
  options.fill = 0.9;
  options.plan.pipeline_order = true;
  EXPECT_THAT(StreamPlanner::Make(options).status().message(),
              HasSubstr("pipeline"));
  options.plan.pipeline_order = false;
  absl::StatusOr<StreamPlanner> planner = StreamPlanner::Make(options);
  ASSERT_TRUE(planner.ok());
  EXPECT_THAT(planner->Add({1, -1, 0, 0}).status().message(),
              HasSubstr("unit 1 has length -1"));
  EXPECT_THAT(planner->Add({1, 1, 0, -2}).status().message(),
              HasSubstr("unit 1 costs -2"));
  ASSERT_TRUE(planner->Add({1, 1, 1, 1}).ok());
  EXPECT_THAT(planner->Add({1, 1, 1, 1}).status().message(),
              HasSubstr("unit 1 was added already"));
  ASSERT_TRUE(planner->Close().ok());
  EXPECT_THAT(planner->Add({2, 1, 1, 1}).status().message(),
              HasSubstr("closed"));
  EXPECT_FALSE(planner->Close().ok());
}

double WorstRank(const std::vector<double>& costs) {
  return *std::max_element(costs.begin(), costs.end());
}

// The planner's workloads as they arrive in three random orders, under both
// cost models: the streamed worst rank within 5% of the whole-batch plan's.
TEST(StreamPlanner, WorstRankWithinFivePercentOfTheWholeBatchPlan) {
  std::mt19937_64 rng = Fresh();
  std::vector<double> ratios, coarse;
  for (const PlanWorkload& w : PlanWorkloads(rng, 1)) {
    for (const CostModel& c : CostModels()) {
      PlanOptions model = w.options;
      model.cost_per_token = c.per_token;
      model.cost_per_token_squared = c.per_token_squared;
      absl::StatusOr<Plan> whole = PlanMicroBatches(w.lengths, {}, model);
      ASSERT_TRUE(whole.ok()) << whole.status();
      std::vector<double> whole_costs(std::max(model.num_ranks, 1), 0.0);
      for (const MicroBatch& m : whole->micro_batches) {
        whole_costs[m.rank] += m.cost;
      }
      std::vector<StreamUnit> units = Units(w.lengths, model, rng);
      // The largest unit's share of a rank's mean cost: a unit that large
      // arriving last cannot be balanced by anything still to come.
      double largest = 0, all = 0;
      for (const StreamUnit& u : units) {
        largest = std::max(largest, u.cost);
        all += u.cost;
      }
      const double share = largest / (all / whole_costs.size());
      const double bound = share <= 0.1 ? 1.05 : 1.4;
      StreamPlanner::Options options;
      options.plan = w.options;
      options.plan.pad_multiple = 0;  // the units come padded
      for (int order = 0; order < 3; ++order) {
        std::shuffle(units.begin(), units.end(), rng);
        const Streamed s = Stream(units, options);
        std::vector<StreamUnit> by_id(units.size());
        for (const StreamUnit& u : units) by_id[u.id] = u;
        ASSERT_EQ(Broken(s, by_id, options), "") << w.name;
        std::vector<double> costs(whole_costs.size(), 0.0);
        for (const Wave& wave : s.waves) {
          for (const MicroBatch& m : wave.micro_batches)
            costs[m.rank] += m.cost;
        }
        const double ratio = WorstRank(costs) / WorstRank(whole_costs);
        (share <= 0.1 ? ratios : coarse).push_back(ratio);
        std::printf(
            "%-36s %-10s order %d: worst rank %.4f of the whole-batch "
            "plan's (largest unit %.3f of a rank); %lld waves while arriving, "
            "%lld micro-batches per rank (whole batch: %lld)\n",
            w.name.c_str(), c.name, order, ratio, share,
            static_cast<long long>(s.committed_before_close),
            static_cast<long long>(s.waves.size()),
            static_cast<long long>(whole->micro_batches_per_rank));
        EXPECT_LE(ratio, bound) << w.name << " " << c.name;
      }
    }
  }
  for (auto* r : {&ratios, &coarse}) {
    if (r->empty()) continue;
    std::sort(r->begin(), r->end());
    std::printf(
        "streamed worst rank / whole-batch worst rank, %s, over %zu runs: "
        "min %.4f median %.4f p90 %.4f max %.4f\n",
        r == &ratios ? "no unit over 0.1 of a rank"
                     : "a unit over 0.1 of a rank",
        r->size(), r->front(), (*r)[r->size() / 2], (*r)[r->size() * 9 / 10],
        r->back());
  }
}

}  // namespace
}  // namespace packd
