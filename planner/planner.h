// The micro-batch planner (docs/design.md §9, §11): a batch of samples, known
// only by their lengths, split into token-budgeted micro-batches over
// data-parallel ranks, every rank with the same number of micro-batches and
// about the same cost (attention grows with the square of a sequence's
// length), and the one global count of loss tokens that the summed token loss
// must be divided by. It works on lengths, not tensors: one call plans the
// whole global batch, and every rank that plans the same request alone gets
// the same plan.
//
// clang-format off
//   PlanOptions options{.max_tokens_per_micro_batch = 16384, .num_ranks = 8,
//                       .cost_per_token = 24576, .cost_per_token_squared = 1};
//   PACKD_ASSIGN_OR_RETURN(Plan plan, PlanMicroBatches(lengths, {}, options));
//   loss = sum_of_token_losses_over_all_micro_batches_and_ranks / plan.global_loss_tokens;
// clang-format on
#ifndef PACKD_PLANNER_PLANNER_H_
#define PACKD_PLANNER_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace packd {

struct PlanOptions {
  // The token budget of one micro-batch; > 0.
  int64_t max_tokens_per_micro_batch = 0;
  // Data-parallel ranks; 0 means 1.
  int32_t num_ranks = 1;
  // Micro-batches per rank are a multiple of this (pipeline schedules); 0
  // means 1.
  int32_t micro_batch_multiple = 1;
  // A sample's cost, from its padded length P: cost_per_token * P +
  // cost_per_token_squared * P^2 (both 0: P). Finite and >= 0.
  double cost_per_token = 0;
  double cost_per_token_squared = 0;
  // Empty, or one cost per sample (finite, >= 0), used instead of the model.
  // Viewed, not copied: it must outlive the call, as groups must.
  absl::Span<const double> costs;
  // Empty, or one id per sample: the samples sharing an id are one unit, in
  // one micro-batch.
  absl::Span<const int64_t> groups;
  // The budget counts each sample's length rounded up to a multiple of this
  // (context-parallel padding); 0 and 1: none.
  int64_t pad_multiple = 0;
  // Each rank's micro-batches emitted costliest in the middle, cheapest at
  // both ends: sorted by cost, largest first, into p, then reversed(p[0::2])
  // followed by p[1::2].
  bool pipeline_order = false;
  // The most micro-batches (over all ranks) a plan may hold; a request whose
  // lower bound passes it is RESOURCE_EXHAUSTED before any planning. 0: none.
  int64_t max_micro_batches = 0;
  // Whether every loss_tokens value must be at most its sample's length. A
  // training step's samples are measured as one CP or SP rank's share of
  // their rows while their loss tokens are the whole row's (docs/design.md
  // §12), so the step turns it off.
  bool loss_tokens_within_lengths = true;
};

struct MicroBatch {
  int32_t rank = 0;
  std::vector<int64_t> samples;  // indices into lengths, ascending
  int64_t tokens = 0;            // sum of their lengths
  int64_t loss_tokens = 0;       // sum of their loss tokens
  double cost = 0;               // sum of their costs
  int64_t padded_tokens = 0;     // sum of their padded lengths: the budget's
};

struct Plan {
  // By rank, then position in the rank: micro_batches_per_rank of each.
  std::vector<MicroBatch> micro_batches;
  int64_t micro_batches_per_rank = 0;
  // Sum of loss_tokens (or lengths): divide the summed token loss by this.
  int64_t global_loss_tokens = 0;
  // Max rank tokens / mean rank tokens (1.0 when there are no tokens).
  double imbalance = 1.0;
  // Max rank cost / mean rank cost (1.0 when nothing costs anything).
  double cost_imbalance = 1.0;
  // Samples with loss tokens: divide a sum of per-sequence mean losses by this.
  int64_t global_sequences = 0;

  // Sets imbalance and cost_imbalance from micro_batches (each rank's tokens
  // and cost summed over its micro-batches) over `ranks` ranks.
  void SetImbalance(int ranks);
};

// Plans `lengths` (tokens per sample; what the budget counts). `loss_tokens`
// is empty (equal to lengths) or one per sample, each at most its length
// (unless options.loss_tokens_within_lengths is off).
//
// Every sample is in exactly one micro-batch, a group's samples all in one; a
// micro-batch's padded tokens are at most the budget unless it is one unit (a
// sample, or a group) that alone exceeds it; every rank has the same number
// of micro-batches, a multiple of micro_batch_multiple; a micro-batch is
// empty only when there are fewer units than micro-batches. The number of
// micro-batches per rank is the fewest the packing finds, starting from
// MicroBatchLowerBound; under it, the largest rank cost is made as small as
// the packing finds, then the micro-batches within each rank are balanced.
//
// Errors: INVALID_ARGUMENT for a negative length, a non-positive budget,
// loss_tokens, costs or groups of another length, a loss_tokens value outside
// [0, its length] (or below 0), loss_tokens summing past 2^53, a negative
// num_ranks, micro_batch_multiple or pad_multiple, a negative or non-finite
// cost or coefficient (or a cost the model makes infinite), or lengths summing
// past 2^53 (the loss divisor would not be exact as a double).
// RESOURCE_EXHAUSTED when the plan would pass max_micro_batches. Any budget is
// taken; one above the total plans as the total.
absl::StatusOr<Plan> PlanMicroBatches(absl::Span<const int64_t> lengths,
                                      absl::Span<const int64_t> loss_tokens,
                                      const PlanOptions& options);

// ceil(total padded tokens / (ranks * budget)), a unit over the budget
// counted as one budget (it fills a micro-batch alone), rounded up to the
// multiple: no plan can have fewer micro-batches per rank. 0 for invalid
// options.
int64_t MicroBatchLowerBound(absl::Span<const int64_t> lengths,
                             const PlanOptions& options);

// The cost of a sequence of `padded` tokens under options' model:
// cost_per_token * P + cost_per_token_squared * P^2, or P when both are 0.
// What the planner costs each sample by (without explicit costs), and what a
// step sums over a row's sequences.
double SequenceCost(const PlanOptions& options, int64_t padded);
// The cost of attention over a segment of `queries` rows with `keys` keys (a
// response attending to its shared prompt too, docs/design.md §14):
// cost_per_token * queries + cost_per_token_squared * queries * keys, or
// queries when both are 0. SequenceCost(P) is SegmentCost(P, P).
double SegmentCost(const PlanOptions& options, int64_t queries, int64_t keys);

}  // namespace packd

#endif  // PACKD_PLANNER_PLANNER_H_
