#include "workloads/peer_planners.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "planner/internal/planner_internal.h"

namespace packd {

using planner_internal::AllUnits;
using planner_internal::Assemble;
using planner_internal::Bins;
using planner_internal::Checked;
using planner_internal::KarmarkarKarp;
using planner_internal::KeepsCap;
using planner_internal::RoundUp;

namespace {

int64_t PaddedOf(const Checked& c, const std::vector<int64_t>& units) {
  int64_t padded = 0;
  for (int64_t u : units) padded += c.units.padded[u];
  return padded;
}

std::vector<double> PaddedValues(const Checked& c) {
  return std::vector<double>(c.units.padded.begin(), c.units.padded.end());
}

}  // namespace

absl::StatusOr<Plan> PlanMicroBatchesLikeVerl(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options) {
  absl::StatusOr<Checked> c =
      planner_internal::Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  const int64_t n = c->units.size();
  const std::vector<std::vector<int64_t>> ranks = KarmarkarKarp(
      PaddedValues(*c), AllUnits(*c), c->ranks, n % c->ranks == 0);
  // Micro-batches per rank: ceil(tokens / budget), the maximum over ranks.
  int64_t m = 1;
  for (const auto& r : ranks) {
    m = std::max(m, (PaddedOf(*c, r) + c->budget - 1) / c->budget);
  }
  for (;;) {
    m = RoundUp(m, c->multiple);
    Bins bins;
    bool over = false;
    for (const auto& r : ranks) {
      bins.push_back(KarmarkarKarp(c->units.cost, r, m, /*equal_size=*/false));
      for (const auto& b : bins.back()) {
        over = over || !KeepsCap(*c, PaddedOf(*c, b), b.size());
      }
    }
    if (!over || m >= std::max<int64_t>(1, n)) {
      return Assemble(bins, *c, lengths, loss_tokens);
    }
    ++m;
  }
}

absl::StatusOr<Plan> PlanMicroBatchesLikeSlime(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options) {
  absl::StatusOr<Checked> c =
      planner_internal::Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  // First fit, in the units' order.
  std::vector<std::vector<int64_t>> batches;
  std::vector<int64_t> fill;
  for (int64_t u = 0; u < c->units.size(); ++u) {
    size_t b = 0;
    while (b < batches.size() &&
           !KeepsCap(*c, fill[b] + c->units.padded[u], batches[b].size() + 1)) {
      ++b;
    }
    if (b == batches.size()) {
      batches.emplace_back();
      fill.push_back(0);
    }
    batches[b].push_back(u);
    fill[b] += c->units.padded[u];
  }
  const int64_t slots = int64_t{c->ranks} * c->multiple;
  const std::vector<double> padded = PaddedValues(*c);
  while (batches.empty() || static_cast<int64_t>(batches.size()) % slots != 0) {
    int64_t largest = -1;
    for (size_t b = 0; b < batches.size(); ++b) {
      if (batches[b].size() >= 2 && (largest < 0 || fill[b] > fill[largest])) {
        largest = static_cast<int64_t>(b);
      }
    }
    if (largest < 0) {
      batches.emplace_back();
      fill.push_back(0);
      continue;
    }
    std::vector<std::vector<int64_t>> halves =
        KarmarkarKarp(padded, batches[largest], 2, /*equal_size=*/false);
    batches[largest] = std::move(halves[0]);
    fill[largest] = PaddedOf(*c, batches[largest]);
    batches.push_back(std::move(halves[1]));
    fill.push_back(PaddedOf(*c, batches.back()));
  }
  // Equal counts of micro-batches per rank, balanced by cost.
  std::vector<double> cost(batches.size(), 0);
  std::vector<int64_t> all(batches.size());
  for (size_t b = 0; b < batches.size(); ++b) {
    all[b] = static_cast<int64_t>(b);
    for (int64_t u : batches[b]) cost[b] += c->units.cost[u];
  }
  Bins bins;
  for (const std::vector<int64_t>& rank :
       KarmarkarKarp(cost, all, c->ranks, /*equal_size=*/true)) {
    bins.emplace_back();
    for (int64_t b : rank) bins.back().push_back(std::move(batches[b]));
  }
  return Assemble(bins, *c, lengths, loss_tokens);
}

}  // namespace packd
