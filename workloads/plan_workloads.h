// The batches the planner is measured on (bench_plan) and checked against its
// peers on (planner_test): RL and SFT batches as trainers send them, each
// with the planning options it is run under. Header-only.
//
//   std::mt19937_64 rng(7);
//   for (const PlanWorkload& w : PlanWorkloads(rng, /*scale=*/1)) ...
#ifndef PACKD_WORKLOADS_PLAN_WORKLOADS_H_
#define PACKD_WORKLOADS_PLAN_WORKLOADS_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "workloads/lengths.h"

namespace packd {

struct PlanWorkload {
  std::string name;
  std::vector<int64_t> lengths;
  // Budget, ranks, multiple and pad; no cost model (see CostModels).
  PlanOptions options;
};

// A cost model: cost_per_token * P + cost_per_token_squared * P^2.
struct CostModel {
  const char* name;
  double per_token;
  double per_token_squared;
};

// verl's workload for a 7B-class model (24576 = 6 x hidden of 4096: the
// linear layers' FLOPs per token against attention's L^2), and attention
// alone (L^2: long contexts, or a small hidden size).
inline std::vector<CostModel> CostModels() {
  return {{"24576L+L^2", 24576, 1}, {"L^2", 0, 1}};
}

inline PlanOptions PlanOptionsOf(int32_t ranks, int64_t budget,
                                 int32_t multiple = 1, int64_t pad = 0) {
  PlanOptions o;
  o.num_ranks = ranks;
  o.max_tokens_per_micro_batch = budget;
  o.micro_batch_multiple = multiple;
  o.pad_multiple = pad;
  return o;
}

// The seven workloads, their sample counts divided by `scale` (1: as
// measured; larger for quick runs).
inline std::vector<PlanWorkload> PlanWorkloads(std::mt19937_64& rng,
                                               int64_t scale) {
  const int64_t n = 1024 / scale;
  std::vector<PlanWorkload> w;
  w.push_back({"RL rollouts, lognormal <= 8192",
               LognormalLengths(rng, n, 6.8, 1.0, 8192),
               PlanOptionsOf(8, 16384)});
  std::vector<int64_t> tail = LognormalLengths(rng, n - n / 50, 6.8, 1.0, 8192);
  for (int64_t v : UniformLengths(rng, n / 50, 24576, 32768)) tail.push_back(v);
  std::shuffle(tail.begin(), tail.end(), rng);
  w.push_back({"long tail, 2% at 24-32k", tail, PlanOptionsOf(8, 32768)});
  w.push_back({"bimodal prompts 64-128 / 8000-8192",
               BimodalLengths(rng, n - n / 8, n / 8), PlanOptionsOf(8, 16384)});
  w.push_back({"uniform 1-4096, pad 8", UniformLengths(rng, 4 * n, 1, 4096),
               PlanOptionsOf(16, 8192, 2, 8)});
  w.push_back({"SFT 512-4096 over 64 ranks",
               UniformLengths(rng, 8 * n, 512, 4096),
               PlanOptionsOf(64, 16384)});
  std::vector<int64_t> few = LognormalLengths(rng, n, 6.5, 0.8, 4096);
  for (int64_t v : UniformLengths(rng, 6, 20000, 32768)) few.push_back(v);
  std::shuffle(few.begin(), few.end(), rng);
  w.push_back(
      {"a few long samples (6 over budget)", few, PlanOptionsOf(8, 16384)});
  w.push_back({"CP-padded rollouts, pad 16",
               LognormalLengths(rng, n, 6.8, 1.0, 8192),
               PlanOptionsOf(8, 16384, 1, 16)});
  return w;
}

}  // namespace packd

#endif  // PACKD_WORKLOADS_PLAN_WORKLOADS_H_
