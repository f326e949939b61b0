// The streaming step (docs/design.md §18) without gRPC: StepRegistry holds the
// steps open on this replica by id; a StreamingStep takes finished groups
// (measured as PackMicroBatches measures rows, copied into the step's memory),
// plans them as they arrive (planner/stream_planner.h), packs every rank's
// micro-batch of each wave committed, and queues it for that rank's receiving
// stream; at close it plans the rest, then queues every receiver its last
// message (the step's plan and global_loss_tokens). Any failure ends the step
// for every party with one status.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto step, registry.Open(tenant, options, controller));
//   step->Submit(tenant, group, &reply);  // from each submitter
//   step->Attach(rank, cp_rank, receiver); step->Next(slot, &end);
//   step->Close();
// clang-format on
#ifndef PACKD_SERVICE_STREAM_STEP_H_
#define PACKD_SERVICE_STREAM_STEP_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/stream_planner.h"
#include "service/memory_budget.h"
#include "service/service_core.h"
#include "service/tenant.h"

namespace packd {

// A stream attached to a step, woken when the step has something for it (a
// message, or its end). Safe to share across threads: Wake may be called
// from any thread; once Detach() has returned it does nothing. The lock is
// recursive: a wake that ends the stream may detach it from within.
class StepListener {
 public:
  explicit StepListener(std::function<void()> wake) : wake_(std::move(wake)) {}
  void Wake() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (wake_) wake_();
  }
  void Detach() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    wake_ = nullptr;
  }

 private:
  std::recursive_mutex mu_;
  std::function<void()> wake_;  // guarded by mu_
};

// Safe to share across threads: every method may be called from several at
// once; mu_ guards its state.
class StreamingStep {
 public:
  using Message = std::shared_ptr<const v1::PackMicroBatchesResponse>;

  // `budget` (--max_inflight_bytes) counts the groups the step holds; it
  // must outlive the step's groups (EndAll before it goes).
  StreamingStep(std::string id, const v1::StepOptions& options,
                StreamPlanner planner, ServiceCore* core, MemoryBudget* budget,
                int cp_ranks, absl::Time deadline);
  ~StreamingStep();

  const std::string& id() const { return id_; }
  absl::Time deadline() const { return deadline_; }

  // A finished group, measured with the step's layout and kept. Errors:
  // FAILED_PRECONDITION for a group older than the staleness bound (naming
  // its version), for tensors in device memory, and once the step is closed
  // or has ended; INVALID_ARGUMENT for a malformed group (PackMicroBatches'
  // errors for its rows, naming its fields) or one whose inputs differ in
  // number, dtype or tail from the step's first group; RESOURCE_EXHAUSTED
  // when the groups held (until their rows are sent) would pass
  // --max_inflight_bytes; the step continues after any of them. A wave the
  // group lets commit is packed and queued before this returns.
  absl::Status Submit(const Tenant& tenant, const v1::SubmitGroupRequest& group,
                      v1::SubmitGroupResponse* reply);

  // The receiver of (rank, cp_rank) attaches: NOT_FOUND-free INVALID_ARGUMENT
  // for a rank outside the step, ALREADY_EXISTS when one is attached already
  // or was, the step's status once it has ended. Returns its slot.
  absl::StatusOr<int> Attach(int rank, int cp_rank,
                             std::shared_ptr<StepListener> listener);
  // The slot's next message, or null: then `end` is set when nothing more
  // will come (OK after its last message; the step's failure otherwise).
  Message Next(int slot, std::optional<absl::Status>* end);
  // The receiver of `slot` has gone: after its last message, or before (the
  // step then ends UNAVAILABLE for every party, naming the rank).
  void Detach(int slot, bool after_last);

  // Plans what is left, packs and queues it, then every receiver's last
  // message. FAILED_PRECONDITION when closed already or ended.
  absl::Status Close();
  // Ends the step with `status` for every party (the first failure wins).
  void Fail(const absl::Status& status);

  // The controller's listener, woken when the step has ended or every
  // receiver has been sent its last message.
  void SetController(std::shared_ptr<StepListener> controller);
  // Whether the step is over: its failure, or OK once every receiver has
  // been sent its last message (then `summary` is the controller's last
  // event); nullopt while it goes on.
  std::optional<absl::Status> Outcome(v1::StepEvent* summary);

 private:
  struct Group {
    int64_t first_row = 0;
    int64_t rows = 0;
    int64_t S = 0;
    std::string mask, segment_ids;
    std::vector<std::string> inputs;
    std::vector<int64_t> prefix_lengths;
    absl::Time arrived;
    int64_t unsent = 0;  // its rows not yet sent: its bytes go with the last
    MemoryBudget::Hold held;  // its bytes, in --max_inflight_bytes
  };
  struct Slot {
    std::deque<Message> queue;
    std::shared_ptr<StepListener> listener;
    bool attached = false;
    bool last_queued = false;
    bool last_sent = false;
  };

  // The group's tensors in the step's memory: inline bytes as they are,
  // region bytes copied out of host regions.
  absl::Status Keep(const Tenant& tenant, const v1::SubmitGroupRequest& group,
                    Group* kept) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The group's bytes in --max_inflight_bytes, or RESOURCE_EXHAUSTED at
  // once when they do not fit.
  absl::StatusOr<MemoryBudget::Hold> Reserve(const Tenant& tenant,
                                             const Group& kept);
  // Packs and queues every receiver's micro-batch of each wave.
  absl::Status Send(const std::vector<Wave>& waves)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The Pack request of a micro-batch's rows (ascending step rows) for the
  // CP or SP rank `cp_rank`.
  v1::PackRequest RowsRequest(const std::vector<int64_t>& rows,
                              int cp_rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step's rows of planner unit `id`.
  void RowsOf(int64_t unit, std::vector<int64_t>* rows) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes every listener (outside mu_).
  void WakeAll();
  void FailLocked(const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION once the step has ended, or (saying `closed`) once it
  // is closed; OK while it takes groups.
  absl::Status StillOpen(absl::string_view closed) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::string id_;
  const v1::StepOptions options_;
  ServiceCore* const core_;
  MemoryBudget* const budget_;
  const int ranks_;
  const int cp_ranks_;
  const absl::Time deadline_;
  const bool
      shared_;  // the layout shares each group's prompt: a group is a unit

  absl::Mutex mu_;
  StreamPlanner planner_ ABSL_GUARDED_BY(mu_);
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  int64_t rows_ ABSL_GUARDED_BY(mu_) = 0;
  // The first group's inputs: every later one must match them.
  std::vector<v1::Tensor> schema_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::DType> segment_dtype_ ABSL_GUARDED_BY(mu_);
  v1::DType mask_dtype_ ABSL_GUARDED_BY(mu_) = v1::DTYPE_UNSPECIFIED;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StepListener> controller_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  // Every micro-batch sent, by rank then position (the last message's plan).
  std::vector<std::vector<v1::MicroBatch>> sent_ ABSL_GUARDED_BY(mu_);
  int64_t waves_before_close_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
  // Rows submitted and not sent, as counted in the metrics' gauge (given back
  // when the step ends).
  int64_t rows_pending_ ABSL_GUARDED_BY(mu_) = 0;
};

// The steps open on this replica. Safe to share across threads; mu_ guards
// the map. A thread ends steps past their deadline.
class StepRegistry {
 public:
  // `budget` counts the groups steps hold; it must outlive every step's
  // groups: call EndAll() before it goes.
  StepRegistry(ServiceCore* core, MemoryBudget* budget);
  ~StepRegistry();

  // Where submitters and receivers reach this replica (--advertise_address,
  // else the address packd listens on). Set once the server listens.
  void SetAddress(std::string address);
  std::string address() const;

  // Opens a step. INVALID_ARGUMENT for options a step cannot take (naming
  // the field), ALREADY_EXISTS for the id of a step open here.
  absl::StatusOr<std::shared_ptr<StreamingStep>> Open(
      const v1::StepOptions& options);
  // NOT_FOUND, naming this replica, for a step not open here.
  absl::StatusOr<std::shared_ptr<StreamingStep>> Find(
      const std::string& id) const;
  // Forgets the step (its memory goes with the last reference).
  void Remove(const std::string& id);
  int64_t open_steps() const;
  // Ends every step (UNAVAILABLE: the server is going) and forgets it.
  void EndAll();

 private:
  void Reap();

  ServiceCore* const core_;
  MemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  std::string address_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<StreamingStep>> steps_
      ABSL_GUARDED_BY(mu_);
  int64_t named_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_STREAM_STEP_H_
