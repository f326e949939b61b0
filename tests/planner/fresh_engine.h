// A random engine seeded from the clock for the planner's tests, its seed
// printed so that a failing run can be replayed.
#ifndef PACKD_TESTS_PLANNER_FRESH_ENGINE_H_
#define PACKD_TESTS_PLANNER_FRESH_ENGINE_H_

#include <chrono>
#include <cstdint>
#include <iostream>
#include <random>

namespace packd {
namespace testing {

inline std::mt19937_64 FreshEngine(const char* suite) {
  const uint64_t seed =
      std::chrono::steady_clock::now().time_since_epoch().count();
  std::cerr << suite << " seed " << seed << "\n";
  return std::mt19937_64(seed);
}

}  // namespace testing
}  // namespace packd

#endif  // PACKD_TESTS_PLANNER_FRESH_ENGINE_H_
