// bench_plan: the micro-batch planner against its peers, verl's planner and
// slime's (planner/peer_planners.h), on the workloads of RL and SFT
// batches under two cost models; and its speed on a large batch.
//
//   bench_plan            # the quality table and the 65,536-sample timing
//   bench_plan --smoke    # small, for ctest
//   bench_plan --seed=11  # other random batches
//   bench_plan --json=plan.json  # also the rows as JSON (benchmarks/plot.py)
//
// For each plan: micro-batches per rank, cost imbalance (max rank cost / mean
// rank cost) and milliseconds in process. "floor" is what the largest unit
// allows: max(1, max sample cost / mean rank cost); no plan is below it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "planner/peer_planners.h"
#include "planner/planner.h"
#include "planner/testing/check_plan.h"
#include "workloads/lengths.h"
#include "workloads/plan_workloads.h"

ABSL_FLAG(bool, smoke, false, "Small workloads, one repeat");
ABSL_FLAG(int, seed, 7, "Random seed of the workloads");
ABSL_FLAG(std::string, json, "", "Also write the rows as JSON to this file");

namespace packd {
namespace {

using Planner = absl::StatusOr<Plan> (*)(absl::Span<const int64_t>,
                                         absl::Span<const int64_t>,
                                         const PlanOptions&);

struct Timed {
  Plan plan;
  double ms;
};

// The plan and the fastest of `repeats` runs; exits when planning fails or
// the plan breaks a rule (the cap above all).
Timed Run(const char* who, Planner planner, const std::vector<int64_t>& lengths,
          const PlanOptions& options, int repeats) {
  Timed t{{}, 1e30};
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<Plan> plan = planner(lengths, {}, options);
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0)
                          .count();
    absl::Status ok =
        plan.ok() ? CheckPlan(*plan, lengths, {}, options) : plan.status();
    if (!ok.ok()) {
      std::fprintf(stderr, "bench_plan: %s: %s\n", who, ok.ToString().c_str());
      std::exit(1);
    }
    t.plan = *std::move(plan);
    t.ms = std::min(t.ms, ms);
  }
  return t;
}

// max(1, the costliest sample / the mean rank cost).
double Floor(const std::vector<int64_t>& lengths, const PlanOptions& o) {
  const int64_t pad = std::max<int64_t>(1, o.pad_multiple);
  double max = 0, total = 0;
  for (int64_t len : lengths) {
    const double p = static_cast<double>((len + pad - 1) / pad * pad);
    const double cost = o.cost_per_token * p + o.cost_per_token_squared * p * p;
    max = std::max(max, cost);
    total += cost;
  }
  return total == 0 ? 1.0
                    : std::max(1.0, max * std::max(1, o.num_ranks) / total);
}

// The padded tokens the cap counts (a unit over the budget as one budget)
// over the capacity of the plan's micro-batches: near 1, the cap leaves cost
// nowhere to go.
double Fill(const std::vector<int64_t>& lengths, const PlanOptions& o,
            int64_t micro_batches_per_rank) {
  const int64_t pad = std::max<int64_t>(1, o.pad_multiple);
  const int64_t budget = o.max_tokens_per_micro_batch;
  double capped = 0;
  for (int64_t len : lengths) {
    capped +=
        static_cast<double>(std::min((len + pad - 1) / pad * pad, budget));
  }
  return capped / (static_cast<double>(budget) * std::max(1, o.num_ranks) *
                   micro_batches_per_rank);
}

struct Verdict {
  int rows = 0, peers_met = 0, level_met = 0;
  std::vector<std::string> json;  // a JSON object a row
};

// One planner's columns of a row, as a JSON object.
std::string PlannerJson(const Plan& plan, double ms) {
  return absl::StrFormat(
      "{\"micro_batches_per_rank\": %d, \"cost_imbalance\": %.6f, "
      "\"ms\": %.3f}",
      plan.micro_batches_per_rank, plan.cost_imbalance, ms);
}

void WriteJson(const std::string& path, const std::vector<std::string>& rows) {
  std::ofstream f(path);
  f << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << "  " << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  f << "]\n";
}

void Row(const PlanWorkload& w, const CostModel& model, int repeats,
         Verdict* verdict) {
  PlanOptions o = w.options;
  o.cost_per_token = model.per_token;
  o.cost_per_token_squared = model.per_token_squared;
  const Timed ours = Run("packd", PlanMicroBatches, w.lengths, o, repeats);
  const Timed verl =
      Run("verl", PlanMicroBatchesLikeVerl, w.lengths, o, repeats);
  const Timed slime =
      Run("slime", PlanMicroBatchesLikeSlime, w.lengths, o, repeats);
  const int64_t bound = MicroBatchLowerBound(w.lengths, o);
  const int64_t multiple = std::max(1, o.micro_batch_multiple);
  const double floor = Floor(w.lengths, o);
  const int64_t m = ours.plan.micro_batches_per_rank;
  const double imb = ours.plan.cost_imbalance;
  // The targets: micro-batches within bound + 1 and at most verl's, cost
  // imbalance at most both peers' ("peers"); and within 1% of the floor
  // ("level").
  const bool peers = m <= (bound + 1 + multiple - 1) / multiple * multiple &&
                     m <= verl.plan.micro_batches_per_rank &&
                     imb <= verl.plan.cost_imbalance + 1e-12 &&
                     imb <= slime.plan.cost_imbalance + 1e-12;
  const bool level = imb <= 1.01 * floor;
  ++verdict->rows;
  verdict->peers_met += peers;
  verdict->level_met += level;
  std::printf(
      "%-36s %-10s %6zu %5d %6lld %3lld %5lld %7.4f | %4lld %8.5f %7.2f | "
      "%4lld %8.5f %7.2f | %4lld %8.5f %7.2f | %5.3f %-6s %s\n",
      w.name.c_str(), model.name, w.lengths.size(), o.num_ranks,
      static_cast<long long>(o.max_tokens_per_micro_batch),
      static_cast<long long>(std::max<int64_t>(1, o.pad_multiple)),
      static_cast<long long>(bound), floor, static_cast<long long>(m), imb,
      ours.ms, static_cast<long long>(verl.plan.micro_batches_per_rank),
      verl.plan.cost_imbalance, verl.ms,
      static_cast<long long>(slime.plan.micro_batches_per_rank),
      slime.plan.cost_imbalance, slime.ms, Fill(w.lengths, o, m),
      peers ? "met" : "MISSED", level ? "met" : "not met");
  // Workload names are plain text (no quotes or backslashes).
  verdict->json.push_back(absl::StrFormat(
      "{\"workload\": \"%s\", \"cost\": \"%s\", \"samples\": %d, "
      "\"ranks\": %d, \"floor\": %.6f, \"packd\": %s, \"verl\": %s, "
      "\"slime\": %s}",
      w.name, model.name, w.lengths.size(), o.num_ranks, floor,
      PlannerJson(ours.plan, ours.ms), PlannerJson(verl.plan, verl.ms),
      PlannerJson(slime.plan, slime.ms)));
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  const int repeats = smoke ? 1 : 3;
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::printf(
      "bench_plan: micro-batches per rank (mb), cost imbalance (max rank cost "
      "/ mean) and ms, packd against verl's and slime's planners\n\n");
  std::printf(
      "%-36s %-10s %6s %5s %6s %3s %5s %7s | %4s %8s %7s | %4s %8s %7s | %4s "
      "%8s %7s | %5s %-6s %s\n",
      "workload", "cost", "n", "ranks", "budget", "pad", "bound", "floor", "mb",
      "packd", "ms", "mb", "verl", "ms", "mb", "slime", "ms", "fill", "peers",
      "level");
  Verdict verdict;
  for (const PlanWorkload& w : PlanWorkloads(rng, smoke ? 8 : 1)) {
    for (const CostModel& model : CostModels()) {
      Row(w, model, repeats, &verdict);
    }
  }
  PlanWorkload big{"65,536 lognormal over 64 ranks",
                   LognormalLengths(rng, smoke ? 4096 : 65536, 6.8, 1.0, 16384),
                   PlanOptionsOf(64, 32768, 4)};
  Row(big, CostModels()[0], repeats, &verdict);
  std::printf(
      "\nbound: ceil(padded total / (ranks x budget)), a sample over the "
      "budget counted as one budget, rounded up to the multiple.\nfill: the "
      "padded tokens the cap counts over the capacity of packd's "
      "micro-batches.\npeers: mb <= bound + 1 and <= verl's, cost imbalance "
      "<= both peers'. level: cost imbalance <= 1.01 x floor.\n"
      "peers met on %d of %d rows; level met on %d of %d rows\n",
      verdict.peers_met, verdict.rows, verdict.level_met, verdict.rows);
  if (!absl::GetFlag(FLAGS_json).empty()) {
    WriteJson(absl::GetFlag(FLAGS_json), verdict.json);
  }
  return 0;
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
