#include "planner/peer_planners.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "planner/internal/partition.h"
#include "planner/internal/units.h"

namespace packd {

using planner_internal::Assemble;
using planner_internal::Checked;
using planner_internal::FirstFit;
using planner_internal::RanksByTokens;
using planner_internal::RoundUp;
using planner_internal::SplitAndDeal;
using planner_internal::SplitByCost;

absl::StatusOr<Plan> PlanMicroBatchesLikeVerl(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options) {
  absl::StatusOr<Checked> c =
      planner_internal::Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  const std::vector<std::vector<int64_t>> ranks = RanksByTokens(*c);
  // Micro-batches per rank: ceil(tokens / budget), the maximum over ranks,
  // one more while a micro-batch breaks the cap (none can with a unit each).
  int64_t m = 1;
  for (const std::vector<int64_t>& r : ranks) {
    int64_t tokens = 0;
    for (int64_t u : r) tokens += c->units.padded[u];
    m = std::max(m, (tokens + c->budget - 1) / c->budget);
  }
  for (m = RoundUp(m, c->multiple);; m = RoundUp(m + 1, c->multiple)) {
    if (std::optional<planner_internal::Bins> bins =
            SplitByCost(*c, ranks, m)) {
      return Assemble(*bins, *c, lengths, loss_tokens);
    }
  }
}

absl::StatusOr<Plan> PlanMicroBatchesLikeSlime(
    absl::Span<const int64_t> lengths, absl::Span<const int64_t> loss_tokens,
    const PlanOptions& options) {
  absl::StatusOr<Checked> c =
      planner_internal::Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  // First fit with room for every unit alone; then as many micro-batches as
  // the next multiple of ranks x micro_batch_multiple.
  std::vector<std::vector<int64_t>> batches =
      *FirstFit(*c, std::max<int64_t>(1, c->units.size()));
  const int64_t per_rank =
      RoundUp(std::max<int64_t>(1, static_cast<int64_t>(batches.size())),
              c->ranks) /
      c->ranks;
  return Assemble(
      SplitAndDeal(*c, std::move(batches), RoundUp(per_rank, c->multiple)), *c,
      lengths, loss_tokens);
}

}  // namespace packd
