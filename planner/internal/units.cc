#include "planner/internal/units.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace packd::planner_internal {
namespace {

// Token sums the planner accepts: the loss is divided by global_loss_tokens,
// a double in every trainer, exact up to 2^53; padded sums as well, so that
// costs of padded lengths are exact too.
constexpr int64_t kMaxTotalTokens = int64_t{1} << 53;

absl::Status CheckCost(double v, absl::string_view what) {
  if (std::isfinite(v) && v >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " is ", v, ": costs must be finite and not negative"));
}

// The units of `groups` (empty: one per sample), ordered by first sample.
void MakeUnits(absl::Span<const int64_t> groups, const Checked& c,
               Units* units) {
  const int64_t n = static_cast<int64_t>(c.padded.size());
  units->samples.resize(n);
  std::iota(units->samples.begin(), units->samples.end(), 0);
  if (groups.empty()) {
    units->padded = c.padded;
    units->cost = c.cost;
    units->begin.resize(n + 1);
    std::iota(units->begin.begin(), units->begin.end(), 0);
    return;
  }
  // By group, then index: each group's samples become consecutive; the
  // units are then ordered by their first sample.
  std::sort(units->samples.begin(), units->samples.end(),
            [&](int64_t a, int64_t b) {
              return groups[a] != groups[b] ? groups[a] < groups[b] : a < b;
            });
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first sample, start)
  for (int64_t at = 0; at < n; ++at) {
    if (at == 0 ||
        groups[units->samples[at]] != groups[units->samples[at - 1]]) {
      runs.push_back({units->samples[at], at});
    }
  }
  std::sort(runs.begin(), runs.end());
  std::vector<int64_t> ordered;
  ordered.reserve(n);
  for (const auto& [first, start] : runs) {
    units->begin.push_back(static_cast<int64_t>(ordered.size()));
    int64_t padded = 0;
    double cost = 0;
    for (int64_t at = start;
         at < n && groups[units->samples[at]] == groups[units->samples[start]];
         ++at) {
      const int64_t i = units->samples[at];
      ordered.push_back(i);
      padded += c.padded[i];
      cost += c.cost[i];
    }
    units->padded.push_back(padded);
    units->cost.push_back(cost);
  }
  units->begin.push_back(n);
  units->samples = std::move(ordered);
}

}  // namespace

absl::StatusOr<Checked> Validate(absl::Span<const int64_t> lengths,
                                 absl::Span<const int64_t> loss_tokens,
                                 const PlanOptions& options) {
  Checked c;
  if (options.max_tokens_per_micro_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens_per_micro_batch must be positive, not ",
                     options.max_tokens_per_micro_batch));
  }
  if (options.num_ranks < 0 || options.micro_batch_multiple < 0 ||
      options.pad_multiple < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_ranks (", options.num_ranks, "), micro_batch_multiple (",
        options.micro_batch_multiple, ") and pad_multiple (",
        options.pad_multiple, ") must not be negative"));
  }
  PACKD_RETURN_IF_ERROR(CheckCost(options.cost_per_token, "cost_per_token"));
  PACKD_RETURN_IF_ERROR(
      CheckCost(options.cost_per_token_squared, "cost_per_token_squared"));
  c.budget = options.max_tokens_per_micro_batch;
  c.ranks = std::max<int32_t>(1, options.num_ranks);
  c.multiple = std::max<int32_t>(1, options.micro_batch_multiple);
  const int64_t pad = std::max<int64_t>(1, options.pad_multiple);
  auto one_per_sample = [&](size_t size, absl::string_view name) {
    if (size == 0 || size == lengths.size()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", size, " entries but lengths has ",
                     lengths.size(), ": give one per sample, or none"));
  };
  PACKD_RETURN_IF_ERROR(one_per_sample(loss_tokens.size(), "loss_tokens"));
  PACKD_RETURN_IF_ERROR(one_per_sample(options.costs.size(), "costs"));
  PACKD_RETURN_IF_ERROR(one_per_sample(options.groups.size(), "groups"));
  c.padded.resize(lengths.size());
  c.cost.resize(lengths.size());
  int64_t padded_total = 0, loss_total = 0;
  double cost_total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "] is ", lengths[i], ", below 0"));
    }
    if (!loss_tokens.empty()) {
      if (loss_tokens[i] < 0 ||
          (options.loss_tokens_within_lengths && loss_tokens[i] > lengths[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("loss_tokens[", i, "] is ", loss_tokens[i],
                         options.loss_tokens_within_lengths
                             ? absl::StrCat("; it must be in [0, lengths[", i,
                                            "] = ", lengths[i], "]")
                             : "; it must not be negative"));
      }
      if (__builtin_add_overflow(loss_total, loss_tokens[i], &loss_total) ||
          loss_total > kMaxTotalTokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the sum of loss_tokens passes 2^53 (", kMaxTotalTokens,
            ") tokens at loss_tokens[", i,
            "]: global_loss_tokens would not be exact as a double"));
      }
    }
    if (__builtin_add_overflow(c.total, lengths[i], &c.total) ||
        c.total > kMaxTotalTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("the sum of lengths passes 2^53 (", kMaxTotalTokens,
                       ") tokens at lengths[", i,
                       "]: global_loss_tokens would not be exact as a double"));
    }
    // ceil(L / pad) * pad, without overflow: L is at most 2^53 here.
    const int64_t blocks = lengths[i] / pad + (lengths[i] % pad != 0);
    if (__builtin_mul_overflow(blocks, pad, &c.padded[i]) ||
        __builtin_add_overflow(padded_total, c.padded[i], &padded_total) ||
        padded_total > kMaxTotalTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the lengths padded to multiples of ", pad,
          " pass 2^53 tokens at lengths[", i, "]: lower pad_multiple"));
    }
    if (!options.costs.empty()) {
      PACKD_RETURN_IF_ERROR(
          CheckCost(options.costs[i], absl::StrCat("costs[", i, "]")));
      c.cost[i] = options.costs[i];
    } else {
      c.cost[i] = SequenceCost(options, c.padded[i]);
      if (!std::isfinite(c.cost[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("the cost model makes sample ", i, " (", c.padded[i],
                         " padded tokens) cost infinity: lower the "
                         "coefficients"));
      }
    }
    cost_total += c.cost[i];
  }
  if (!std::isfinite(cost_total)) {
    return absl::InvalidArgumentError(
        "the samples' costs sum to infinity: scale them down");
  }
  MakeUnits(options.groups, c, &c.units);
  for (int64_t p : c.units.padded) c.capped_total += std::min(p, c.budget);
  // A budget above the total fits every unit, as the total does: plan with
  // the smaller, so sums of fills and budgets stay far from int64's limit.
  c.budget = std::min(c.budget, std::max<int64_t>(1, padded_total));
  return c;
}

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

int64_t LowerBound(const Checked& c) {
  int64_t capacity;
  // Capacity past int64 holds any capped total (at most 2^53): one suffices.
  const int64_t bound =
      __builtin_mul_overflow(int64_t{c.ranks}, c.budget, &capacity)
          ? 1
          : c.capped_total / capacity + (c.capped_total % capacity != 0);
  return RoundUp(std::max<int64_t>(1, bound), c.multiple);
}

std::vector<int64_t> AllUnits(const Checked& c) {
  std::vector<int64_t> all(c.units.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
}

std::vector<double> PaddedValues(const Checked& c) {
  return std::vector<double>(c.units.padded.begin(), c.units.padded.end());
}

Plan Assemble(const Bins& bins, const Checked& c,
              absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> loss_tokens) {
  Plan plan;
  plan.micro_batches_per_rank = bins.empty() ? 0 : bins[0].size();
  for (size_t r = 0; r < bins.size(); ++r) {
    for (const std::vector<int64_t>& units : bins[r]) {
      MicroBatch mb;
      mb.rank = static_cast<int32_t>(r);
      for (int64_t u : units) {
        mb.samples.insert(mb.samples.end(),
                          c.units.samples.begin() + c.units.begin[u],
                          c.units.samples.begin() + c.units.begin[u + 1]);
      }
      std::sort(mb.samples.begin(), mb.samples.end());
      for (int64_t i : mb.samples) {
        const int64_t loss = loss_tokens.empty() ? lengths[i] : loss_tokens[i];
        mb.tokens += lengths[i];
        mb.loss_tokens += loss;
        mb.padded_tokens += c.padded[i];
        mb.cost += c.cost[i];
        plan.global_sequences += loss > 0;
      }
      plan.global_loss_tokens += mb.loss_tokens;
      plan.micro_batches.push_back(std::move(mb));
    }
  }
  plan.SetImbalance(static_cast<int>(bins.size()));
  return plan;
}

}  // namespace packd::planner_internal
