#include "proto/plan_codec.h"

#include <utility>

namespace packd {

PlanOptions PlanOptionsOf(const v1::PlanRequest& request) {
  PlanOptions options;
  options.max_tokens_per_micro_batch = request.max_tokens_per_micro_batch();
  options.num_ranks = request.num_ranks();
  options.micro_batch_multiple = request.micro_batch_multiple();
  options.cost_per_token = request.cost_per_token();
  options.cost_per_token_squared = request.cost_per_token_squared();
  options.costs =
      absl::MakeConstSpan(request.costs().data(), request.costs_size());
  options.groups =
      absl::MakeConstSpan(request.groups().data(), request.groups_size());
  options.pad_multiple = request.pad_multiple();
  options.pipeline_order = request.pipeline_order();
  return options;
}

absl::Span<const int64_t> LengthsOf(const v1::PlanRequest& request) {
  return absl::MakeConstSpan(request.lengths().data(), request.lengths_size());
}

absl::Span<const int64_t> LossTokensOf(const v1::PlanRequest& request) {
  return absl::MakeConstSpan(request.loss_tokens().data(),
                             request.loss_tokens_size());
}

v1::PlanRequest PlanRequestOf(const PlanOptions& options,
                              absl::Span<const int64_t> lengths,
                              absl::Span<const int64_t> loss_tokens) {
  v1::PlanRequest request;
  request.mutable_lengths()->Assign(lengths.begin(), lengths.end());
  request.mutable_loss_tokens()->Assign(loss_tokens.begin(), loss_tokens.end());
  request.set_max_tokens_per_micro_batch(options.max_tokens_per_micro_batch);
  request.set_num_ranks(options.num_ranks);
  request.set_micro_batch_multiple(options.micro_batch_multiple);
  request.set_cost_per_token(options.cost_per_token);
  request.set_cost_per_token_squared(options.cost_per_token_squared);
  request.mutable_costs()->Assign(options.costs.begin(), options.costs.end());
  request.mutable_groups()->Assign(options.groups.begin(),
                                   options.groups.end());
  request.set_pad_multiple(options.pad_multiple);
  request.set_pipeline_order(options.pipeline_order);
  return request;
}

void EncodePlan(const Plan& plan, v1::PlanResponse* response) {
  response->Clear();
  for (const MicroBatch& mb : plan.micro_batches) {
    v1::MicroBatch* out = response->add_micro_batches();
    out->set_rank(mb.rank);
    out->mutable_samples()->Assign(mb.samples.begin(), mb.samples.end());
    out->set_tokens(mb.tokens);
    out->set_loss_tokens(mb.loss_tokens);
    out->set_cost(mb.cost);
    out->set_padded_tokens(mb.padded_tokens);
  }
  response->set_micro_batches_per_rank(plan.micro_batches_per_rank);
  response->set_global_loss_tokens(plan.global_loss_tokens);
  response->set_imbalance(plan.imbalance);
  response->set_cost_imbalance(plan.cost_imbalance);
  response->set_global_sequences(plan.global_sequences);
}

Plan PlanOf(const v1::PlanResponse& response) {
  Plan plan;
  for (const v1::MicroBatch& mb : response.micro_batches()) {
    MicroBatch out;
    out.rank = mb.rank();
    out.samples.assign(mb.samples().begin(), mb.samples().end());
    out.tokens = mb.tokens();
    out.loss_tokens = mb.loss_tokens();
    out.cost = mb.cost();
    out.padded_tokens = mb.padded_tokens();
    plan.micro_batches.push_back(std::move(out));
  }
  plan.micro_batches_per_rank = response.micro_batches_per_rank();
  plan.global_loss_tokens = response.global_loss_tokens();
  plan.imbalance = response.imbalance();
  plan.cost_imbalance = response.cost_imbalance();
  plan.global_sequences = response.global_sequences();
  return plan;
}

}  // namespace packd
