// packctl plan: lengths from a file or a distribution planned into
// micro-batches over ranks; the imbalances beside the peers' (verl, slime),
// the global counts and a picture of the ranks.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "packctl/packctl.h"
#include "planner/peer_planners.h"
#include "proto/plan_codec.h"
#include "workloads/lengths.h"

namespace packd::packctl {
namespace {

// The lengths to plan: --lengths_file's, one per line, else --samples drawn
// from --distribution.
absl::StatusOr<std::vector<int64_t>> PlanLengths(
    const PlanCommandOptions& options) {
  std::vector<int64_t> lengths;
  const std::string& file = options.lengths_file;
  if (!file.empty()) {
    std::ifstream f(file);
    if (!f)
      return absl::InvalidArgumentError("cannot read --lengths_file=" + file);
    std::string line;
    while (std::getline(f, line)) {
      if (line.empty()) continue;
      int64_t v = 0;
      if (!absl::SimpleAtoi(line, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--lengths_file: \"", line, "\" is not a length"));
      }
      lengths.push_back(v);
    }
    return lengths;
  }
  std::mt19937_64 rng(std::random_device{}());
  const std::string& d = options.distribution;
  const int64_t n = std::max(0, options.samples);
  if (d == "lognormal") return LognormalLengths(rng, n, 6.8, 1.0, 8192);
  if (d == "uniform") return UniformLengths(rng, n, 1, 4096);
  if (d == "bimodal") return BimodalLengths(rng, n - n / 8, n / 8);
  return absl::InvalidArgumentError(
      "--distribution must be lognormal, uniform or bimodal");
}

}  // namespace

int PlanCommand(Connection& connection, const PlanCommandOptions& command) {
  absl::StatusOr<std::vector<int64_t>> lengths = PlanLengths(command);
  if (!lengths.ok())
    return Fail(kUsage, std::string(lengths.status().message()));
  const PlanOptions& options = command.plan;
  absl::StatusOr<v1::PlanResponse> plan =
      connection.Plan(PlanRequestOf(options, *lengths, {}));
  if (!plan.ok()) return Fail(kRpcError, plan.status().ToString());
  int64_t total = 0;
  for (int64_t v : *lengths) total += v;
  const int32_t ranks = std::max(1, options.num_ranks);
  std::printf(
      "%zu samples, %lld tokens, %d ranks, budget %lld, multiple %d, pad %lld, "
      "cost %s\n",
      lengths->size(), static_cast<long long>(total), ranks,
      static_cast<long long>(options.max_tokens_per_micro_batch),
      std::max(1, options.micro_batch_multiple),
      static_cast<long long>(std::max<int64_t>(1, options.pad_multiple)),
      !command.by_cost ? "P (tokens)"
                       : absl::StrCat(options.cost_per_token, "*P + ",
                                      options.cost_per_token_squared, "*P^2")
                             .c_str());
  std::printf(
      "packd:       %lld micro-batches per rank (lower bound %lld), cost "
      "imbalance %.5f, token imbalance %.5f\n",
      static_cast<long long>(plan->micro_batches_per_rank()),
      static_cast<long long>(MicroBatchLowerBound(*lengths, options)),
      plan->cost_imbalance(), plan->imbalance());
  for (const auto& [name, peer] :
       {std::make_pair("verl", PlanMicroBatchesLikeVerl(*lengths, {}, options)),
        std::make_pair("slime",
                       PlanMicroBatchesLikeSlime(*lengths, {}, options))}) {
    if (!peer.ok()) continue;
    std::printf("peer %-6s  %lld micro-batches per rank, cost imbalance %.5f\n",
                name, static_cast<long long>(peer->micro_batches_per_rank),
                peer->cost_imbalance);
  }
  std::printf(
      "global_loss_tokens: %lld (divide the summed token loss by this); "
      "global_sequences: %lld (a sum of sequence-mean losses)\n",
      static_cast<long long>(plan->global_loss_tokens()),
      static_cast<long long>(plan->global_sequences()));
  PrintPlanPicture(*plan, ranks);
  return kOk;
}

}  // namespace packd::packctl
