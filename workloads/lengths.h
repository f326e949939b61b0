// Synthetic sample lengths for planning: the workloads the planner is measured
// on (bench_plan), tested on (planner_test) and tried with (packctl plan).
// Header-only.
//
// clang-format off
//   std::mt19937_64 rng(7);
//   std::vector<int64_t> rollouts = LognormalLengths(rng, 1024, 6.8, 1.0, 8192);
// clang-format on
#ifndef PACKD_WORKLOADS_LENGTHS_H_
#define PACKD_WORKLOADS_LENGTHS_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace packd {

// RL rollouts: lognormal(mu, sigma), clipped to [1, max].
inline std::vector<int64_t> LognormalLengths(std::mt19937_64& rng, int64_t n,
                                             double mu, double sigma,
                                             int64_t max) {
  std::lognormal_distribution<double> d(mu, sigma);
  std::vector<int64_t> out(n);
  for (int64_t& v : out) {
    v = std::clamp<int64_t>(static_cast<int64_t>(d(rng)), 1, max);
  }
  return out;
}

// Uniform in [lo, hi].
inline std::vector<int64_t> UniformLengths(std::mt19937_64& rng, int64_t n,
                                           int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> d(lo, hi);
  std::vector<int64_t> out(n);
  for (int64_t& v : out) v = d(rng);
  return out;
}

// A bimodal mix, shuffled: `n_short` of 64-128 tokens and `n_long` of
// 8000-8192.
inline std::vector<int64_t> BimodalLengths(std::mt19937_64& rng,
                                           int64_t n_short, int64_t n_long) {
  std::vector<int64_t> out = UniformLengths(rng, n_short, 64, 128);
  for (int64_t v : UniformLengths(rng, n_long, 8000, 8192)) out.push_back(v);
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

}  // namespace packd

#endif  // PACKD_WORKLOADS_LENGTHS_H_
