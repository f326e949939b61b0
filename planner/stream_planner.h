// StreamPlanner: the global batch planned while it arrives (docs/design.md
// §18). Units (a row, or a group sharing its prompt) come one at a time with
// their padded lengths, loss tokens and costs; whenever the pool of units not
// yet assigned can fill one micro-batch for every rank to `fill` of the budget
// or more (and keep a reserve for the close), a wave is committed: one
// micro-batch per rank, the units water-filled by cost under the budget, a
// rank that already costs more than a filled one taking less. At close the
// rest goes into as many micro-batches per rank as PlanMicroBatches needs for
// it, costliest unit first to the rank that has cost least so far, so every
// rank ends with the same number of micro-batches. Plain values; no tensors.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(StreamPlanner planner, StreamPlanner::Make({.plan = options}));
//   for (const StreamUnit& u : arriving) {
//     PACKD_ASSIGN_OR_RETURN(std::vector<Wave> waves, planner.Add(u));
//     for (const Wave& w : waves) send(w);
//   }
//   PACKD_ASSIGN_OR_RETURN(std::vector<Wave> rest, planner.Close());
// clang-format on
#ifndef PACKD_PLANNER_STREAM_PLANNER_H_
#define PACKD_PLANNER_STREAM_PLANNER_H_

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/planner.h"

namespace packd {

// One unit of a streamed batch: what the budget counts (its length padded,
// on one CP or SP rank), its loss tokens and its cost. `id` names it in the
// micro-batches' samples.
struct StreamUnit {
  int64_t id = 0;
  int64_t length = 0;
  int64_t loss_tokens = 0;
  double cost = 0;
};

// One micro-batch per rank, micro_batches[r].rank == r; samples are unit ids,
// ascending. An empty micro-batch has no samples.
struct Wave {
  std::vector<MicroBatch> micro_batches;
};

// Not safe to share across threads: its owner serialises every call.
class StreamPlanner {
 public:
  struct Options {
    // Budget, ranks and micro_batch_multiple (the step's micro-batches per
    // rank are made a multiple of it at close, with empty micro-batches);
    // costs, groups, pad_multiple and pipeline_order must be unset (units
    // come padded, with their costs, and are never split).
    PlanOptions plan;
    // A wave is committed once every rank's micro-batch holds at least this
    // fraction of the budget; in (0, 1].
    double fill = 0.9;
    // Micro-batches per rank (of `fill` tokens each) that waves leave in the
    // pool for the close, which balances them against what every rank has had:
    // a long unit arriving last is balanced by them. 0: none.
    double reserve = 1;
  };

  // INVALID_ARGUMENT for a budget <= 0, negative ranks or multiple, a fill
  // outside (0, 1], a negative reserve, or any of the fields Options says must
  // be unset.
  static absl::StatusOr<StreamPlanner> Make(const Options& options);

  // Adds a unit to the pool and returns the waves it lets commit (usually
  // none or one). INVALID_ARGUMENT for a negative length or loss tokens, a
  // negative or non-finite cost, an id already added, or a call after
  // Close(); the unit is then not added.
  absl::StatusOr<std::vector<Wave>> Add(const StreamUnit& unit);

  // Commits one wave of what the pool holds now, water-filled as a wave is
  // but under-filled if need be and leaving no reserve: what its owner does
  // when the units it holds back fill its memory, so that they never pin it.
  // False (nothing committed) when the pool is empty or the plan is closed.
  bool CommitUnderFilled(Wave* wave);

  // Plans every unit still in the pool as PlanMicroBatches would (the same
  // errors), then pads every rank to a multiple of micro_batch_multiple with
  // empty micro-batches; its waves follow the committed ones. At most once.
  absl::StatusOr<std::vector<Wave>> Close();

  // Every micro-batch committed so far, by rank then position (samples are
  // unit ids), with the plan's counts and balance: after Close, the step's
  // whole plan (global_sequences, which units do not tell, left 0).
  Plan plan() const;

  // Each rank's summed cost of the micro-batches committed so far.
  const std::vector<double>& rank_costs() const { return rank_costs_; }
  // Units in the pool (added, not yet in a wave).
  size_t pending() const { return pool_.size(); }
  int64_t waves() const { return waves_; }
  // The sum of every added unit's loss tokens: the step's divisor.
  int64_t loss_tokens() const { return loss_tokens_; }

 private:
  explicit StreamPlanner(const Options& options) : options_(options) {}
  int32_t ranks() const {
    return options_.plan.num_ranks > 0 ? options_.plan.num_ranks : 1;
  }
  // Commits one wave from the pool when it can fill every rank; true if so.
  bool TryWave(Wave* wave);
  // Each rank's micro-batch of the pool's units, largest first into the rank
  // that costs least with it, under the budget; `taken` marks the units
  // placed.
  void WaterFill(std::vector<MicroBatch>* bins, std::vector<char>* taken) const;
  // Commits `bins` as the next wave and takes the units `taken` marks out of
  // the pool.
  void Commit(std::vector<MicroBatch>* bins, const std::vector<char>& taken,
              Wave* wave);

  Options options_;
  std::vector<StreamUnit> pool_;
  std::unordered_set<int64_t> ids_;  // every id added
  std::vector<double> rank_costs_;
  // By rank: every micro-batch committed.
  std::vector<std::vector<MicroBatch>> committed_;
  int64_t waves_ = 0;
  int64_t loss_tokens_ = 0;
  bool closed_ = false;
};

}  // namespace packd

#endif  // PACKD_PLANNER_STREAM_PLANNER_H_
