// bench_plan: the micro-batch planner against its peer (verl's planner:
// Karmarkar-Karp over ranks, then per rank ceil(tokens / budget) micro-batches
// split with Karmarkar-Karp) and the lower bound, on the workloads of RL and
// SFT batches, and its speed on a large batch.
//
//   bench_plan            # the quality table and the 65,536-sample timing
//   bench_plan --smoke    # small, for ctest
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "planner/planner.h"
#include "workloads/lengths.h"
#include "workloads/verl_planner.h"

ABSL_FLAG(bool, smoke, false, "Small workloads, few repeats");
ABSL_FLAG(int, seed, 7, "Random seed of the workloads");

namespace packd {
namespace {

template <typename Fn>
double Ms(Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - t0)
      .count();
}

void Row(const char* name, const std::vector<int64_t>& lengths,
         const PlanOptions& options) {
  absl::StatusOr<Plan> ours, peer;
  const double ours_ms =
      Ms([&] { ours = PlanMicroBatches(lengths, {}, options); });
  const double peer_ms =
      Ms([&] { peer = PlanMicroBatchesLikeVerl(lengths, {}, options); });
  if (!ours.ok() || !peer.ok() ||
      !CheckPlan(*ours, lengths, {}, options).ok()) {
    std::fprintf(stderr, "bench_plan: %s: planning failed\n", name);
    std::exit(1);
  }
  std::printf(
      "%-32s %7zu %5d %6lld %4d %5lld | %5lld %9.6f %7.2f | %5lld %9.6f "
      "%7.2f\n",
      name, lengths.size(), options.num_ranks,
      static_cast<long long>(options.max_tokens_per_micro_batch),
      std::max(1, options.micro_batch_multiple),
      static_cast<long long>(MicroBatchLowerBound(lengths, options)),
      static_cast<long long>(ours->micro_batches_per_rank), ours->imbalance,
      ours_ms, static_cast<long long>(peer->micro_batches_per_rank),
      peer->imbalance, peer_ms);
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::printf(
      "bench_plan: micro-batches per rank and imbalance (max rank tokens / "
      "mean), packd against the peer (verl's planner) and the lower bound\n\n");
  std::printf("%-32s %7s %5s %6s %4s %5s | %5s %9s %7s | %5s %9s %7s\n",
              "workload", "samples", "ranks", "budget", "mult", "bound",
              "packd", "imbal", "ms", "peer", "imbal", "ms");
  const int64_t scale = smoke ? 8 : 1;
  PlanOptions rl;
  rl.num_ranks = 8;
  rl.max_tokens_per_micro_batch = 16384;
  Row("RL rollouts, lognormal <= 8192",
      LognormalLengths(rng, 1024 / scale, 6.8, 1.0, 8192), rl);
  Row("bimodal 64-128 / 8000-8192",
      BimodalLengths(rng, 900 / scale, 124 / scale), rl);
  PlanOptions uni;
  uni.num_ranks = 16;
  uni.max_tokens_per_micro_batch = 8192;
  uni.micro_batch_multiple = 2;
  Row("uniform 1-4096", UniformLengths(rng, 4096 / scale, 1, 4096), uni);
  PlanOptions big;
  big.num_ranks = 64;
  big.max_tokens_per_micro_batch = 32768;
  big.micro_batch_multiple = 4;
  Row("65,536 lognormal over 64 ranks",
      LognormalLengths(rng, 65536 / scale, 6.8, 1.0, 16384), big);
  std::printf(
      "\n(lower bound: ceil(total / (ranks x budget)), a sample over the "
      "budget counted as one budget, rounded up to the multiple)\n");
  return 0;
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
