#include "planner/testing/check_plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/internal/units.h"

namespace packd {

using planner_internal::Checked;
using planner_internal::KeepsCap;
using planner_internal::Validate;

absl::Status CheckPlan(const Plan& plan, absl::Span<const int64_t> lengths,
                       absl::Span<const int64_t> loss_tokens,
                       const PlanOptions& options) {
  absl::StatusOr<Checked> c = Validate(lengths, loss_tokens, options);
  if (!c.ok()) return c.status();
  auto broken = [](auto... what) {
    return absl::InternalError(absl::StrCat("plan breaks: ", what...));
  };
  const int64_t m = plan.micro_batches_per_rank;
  if (m <= 0 || m % c->multiple != 0) {
    return broken("micro_batches_per_rank ", m,
                  " is not a positive multiple of ", c->multiple);
  }
  int64_t slots;
  if (__builtin_mul_overflow(m, int64_t{c->ranks}, &slots) ||
      static_cast<int64_t>(plan.micro_batches.size()) != slots) {
    return broken(plan.micro_batches.size(), " micro-batches for ", c->ranks,
                  " ranks of ", m);
  }
  std::vector<int64_t> unit_of(lengths.size());
  for (int64_t u = 0; u < c->units.size(); ++u) {
    for (int64_t at = c->units.begin[u]; at < c->units.begin[u + 1]; ++at) {
      unit_of[c->units.samples[at]] = u;
    }
  }
  auto near = [](double a, double b) {
    return std::abs(a - b) <= 1e-9 * std::max({1.0, std::abs(a), std::abs(b)});
  };
  std::vector<int> seen(lengths.size(), 0);
  std::vector<int64_t> batch_of(c->units.size(), -1);
  std::vector<double> rank_cost(c->ranks, 0);
  int64_t loss = 0, empty = 0, sequences = 0;
  for (size_t j = 0; j < plan.micro_batches.size(); ++j) {
    const MicroBatch& mb = plan.micro_batches[j];
    if (mb.rank != static_cast<int32_t>(j / m)) {
      return broken("micro-batch ", j, " has rank ", mb.rank);
    }
    int64_t tokens = 0, mb_loss = 0, padded = 0, units = 0;
    double cost = 0;
    for (int64_t i : mb.samples) {
      if (i < 0 || i >= static_cast<int64_t>(lengths.size()) || seen[i]++) {
        return broken("sample ", i, " is out of range or placed twice");
      }
      const int64_t u = unit_of[i];
      if (batch_of[u] < 0) {
        batch_of[u] = static_cast<int64_t>(j);
        ++units;
      } else if (batch_of[u] != static_cast<int64_t>(j)) {
        return broken("the group of sample ", i,
                      " is split over micro-batches ", batch_of[u], " and ", j);
      }
      const int64_t sample_loss =
          loss_tokens.empty() ? lengths[i] : loss_tokens[i];
      tokens += lengths[i];
      mb_loss += sample_loss;
      padded += c->padded[i];
      cost += c->cost[i];
      sequences += sample_loss > 0;
    }
    if (tokens != mb.tokens || mb_loss != mb.loss_tokens ||
        padded != mb.padded_tokens || !near(cost, mb.cost)) {
      return broken("micro-batch ", j, " sums are wrong");
    }
    if (!KeepsCap(*c, padded, units)) {
      return broken("micro-batch ", j, " holds ", padded, " padded tokens in ",
                    units, " units, over the budget ", c->budget);
    }
    empty += mb.samples.empty();
    loss += mb_loss;
    rank_cost[mb.rank] += cost;
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != 1) return broken("sample ", i, " is not placed");
  }
  if (empty > 0 && c->units.size() >= slots) {
    return broken(empty, " empty micro-batches with ", c->units.size(),
                  " units for ", slots, " micro-batches");
  }
  if (loss != plan.global_loss_tokens) {
    return broken("global_loss_tokens ", plan.global_loss_tokens, " != ", loss);
  }
  if (sequences != plan.global_sequences) {
    return broken("global_sequences ", plan.global_sequences,
                  " != ", sequences);
  }
  double total = 0;
  for (double v : rank_cost) total += v;
  const double imbalance =
      total == 0 ? 1.0
                 : *std::max_element(rank_cost.begin(), rank_cost.end()) *
                       c->ranks / total;
  if (!near(imbalance, plan.cost_imbalance)) {
    return broken("cost_imbalance ", plan.cost_imbalance, " != ", imbalance);
  }
  if (options.pipeline_order) {
    for (int64_t start = 0; start < slots; start += m) {
      std::vector<double> p;
      for (int64_t j = start; j < start + m; ++j) {
        p.push_back(plan.micro_batches[j].cost);
      }
      std::sort(p.begin(), p.end(), std::greater<>());
      std::vector<double> expected;
      for (int64_t j = (m - 1) / 2 * 2; j >= 0; j -= 2)
        expected.push_back(p[j]);
      for (int64_t j = 1; j < m; j += 2) expected.push_back(p[j]);
      for (int64_t j = 0; j < m; ++j) {
        if (plan.micro_batches[start + j].cost != expected[j]) {
          return broken("rank ", start / m,
                        " is not in pipeline order at micro-batch ", j);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace packd
