#include "workloads/verl_planner.h"

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "planner/internal/planner_internal.h"

namespace packd {

using planner_internal::Assemble;
using planner_internal::Bins;
using planner_internal::Checked;
using planner_internal::KarmarkarKarp;
using planner_internal::RoundUp;

absl::StatusOr<Plan> PlanMicroBatchesLikeVerl(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options) {
  absl::StatusOr<Checked> c =
      planner_internal::Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  const std::vector<std::vector<int64_t>> ranks =
      KarmarkarKarp(lengths, all, c->ranks, n % c->ranks == 0);
  // Micro-batches per rank: ceil(tokens / budget), the maximum over ranks.
  int64_t m = 1;
  for (const auto& r : ranks) {
    int64_t tokens = 0;
    for (int64_t i : r) tokens += lengths[i];
    m = std::max(m, (tokens + c->budget - 1) / c->budget);
  }
  for (;;) {
    m = RoundUp(m, c->multiple);
    Bins bins;
    bool over = false;
    for (const auto& r : ranks) {
      bins.push_back(KarmarkarKarp(lengths, r, m, /*equal_size=*/false));
      for (const auto& b : bins.back()) {
        int64_t tokens = 0;
        for (int64_t i : b) tokens += lengths[i];
        over = over || (b.size() > 1 && tokens > c->budget);
      }
    }
    if (!over || m >= std::max<int64_t>(1, n)) {
      return Assemble(std::move(bins), lengths, loss_tokens);
    }
    ++m;
  }
}

}  // namespace packd
