// The streaming step (docs/design.md §18) without gRPC (service/step_registry.h
// holds the steps open on this replica, each its tenant's); a
// StreamingStep takes finished groups (measured as PackMicroBatches measures
// rows, copied into the step's memory row by row, each group once by its key),
// plans them as they arrive (planner/stream_planner.h) and queues every rank's
// micro-batch of each wave committed; a micro-batch is packed when its rank's
// stream asks for it, so a slow rank slows the waves and the step's bytes stay
// in --max_inflight_bytes until its stream has taken them. At close it plans
// the rest, then queues every receiver its last message (the step's plan and
// global_loss_tokens). Any failure ends the step for every party with one
// status.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto step, registry.Open(tenant, options));
//   PACKD_ASSIGN_OR_RETURN(auto same, registry.Find(submitter, id, StepAccess::kSubmit));
//   same->Submit(submitter, group, &reply);  // from each submitter
//   PACKD_ASSIGN_OR_RETURN(int slot, step->Attach(rank, cp_rank, receiver));
//   StreamingStep::Message m = step->Next(slot, &end);  // write m->response, then drop m
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
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/stream_planner.h"
#include "service/memory_budget.h"
#include "service/metrics.h"
#include "service/request_decoder.h"
#include "service/service_core.h"
#include "service/stream_rows.h"
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
  // A message for a receiving stream; a micro-batch's bytes stay in
  // --max_inflight_bytes until the stream has taken it and drops it.
  struct Outgoing {
    Outgoing() = default;
    Outgoing(const Outgoing&) = delete;
    Outgoing& operator=(const Outgoing&) = delete;
    ~Outgoing() {
      if (gauge != nullptr) gauge->Decrement(static_cast<double>(bytes));
    }
    v1::PackMicroBatchesResponse response;
    MemoryBudget::Hold held;
    prometheus::Gauge* gauge = nullptr;  // the step's micro_batches gauge
    int64_t bytes = 0;
  };
  using Message = std::shared_ptr<const Outgoing>;

  // `budget` (--max_inflight_bytes) counts what the step holds; it must
  // outlive the step's groups (EndAll before it goes). `owner`: the tenant
  // that opened it.
  StreamingStep(std::string id, Tenant owner, const v1::StepOptions& options,
                StreamPlanner planner, ServiceCore* core, MemoryBudget* budget,
                int cp_ranks, absl::Time deadline);
  ~StreamingStep();

  const std::string& id() const { return id_; }
  const Tenant& owner() const { return owner_; }
  absl::Time deadline() const { return deadline_; }
  absl::Time opened() const { return opened_; }
  // Whether `tenant` may submit groups: the owner, or a tenant the open
  // named in `submitters`.
  bool TakesGroupsFrom(const Tenant& tenant) const;

  // A finished group, measured with the step's layout and kept. A repeat of
  // a group_key taken already gets the first reply and changes nothing.
  // Errors: ALREADY_EXISTS for a taken key with other content;
  // FAILED_PRECONDITION for a group older than the staleness bound (naming
  // its version), for tensors in device memory, and once the step is closed
  // or has ended; INVALID_ARGUMENT for a group without rows, a malformed one
  // (PackMicroBatches' errors for its rows, naming its fields) or one whose
  // inputs differ in number, dtype or tail from the step's first group;
  // RESOURCE_EXHAUSTED when its bytes do not fit --max_inflight_bytes now
  // (the step then commits what its planner holds back as an under-filled
  // wave, so that room comes once the ranks have read it); the step
  // continues after any of them. A wave the group lets commit is queued
  // before this returns.
  absl::Status Submit(const Tenant& tenant, const v1::SubmitGroupRequest& group,
                      v1::SubmitGroupResponse* reply);

  // The receiver of (rank, cp_rank) attaches: NOT_FOUND-free INVALID_ARGUMENT
  // for a rank outside the step, ALREADY_EXISTS when one is attached already
  // or was, the step's status once it has ended. Returns its slot.
  absl::StatusOr<int> Attach(int rank, int cp_rank,
                             std::shared_ptr<StepListener> listener);
  // The slot's next message (a micro-batch packed now, outside the step's
  // lock), or null: then `end` is set when nothing more will come (OK after
  // its last message; the step's failure otherwise). The stream asks for the
  // next once it has taken this one.
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
  // A micro-batch committed and not yet packed for every CP or SP rank.
  struct Planned {
    MicroBatch batch;  // rank, samples (ascending step rows), sizes
    int index = 0;     // its position in its rank
    int unpacked = 0;  // CP or SP ranks still to pack it
  };
  // A receiver's slot goes through these in order: no stream yet; a stream
  // receiving its micro-batches; the last message given to it; the stream
  // gone after sending it (what Outcome waits for).
  enum class SlotState { kUnattached, kReceiving, kLastGiven, kLastSent };
  struct Slot {
    std::deque<std::shared_ptr<Planned>> planned;
    Message last;  // queued at the close
    std::shared_ptr<StepListener> listener;
    SlotState state = SlotState::kUnattached;
  };
  // A group_key taken: the digest of its group's content, and its reply.
  struct Taken {
    std::string digest;
    v1::SubmitGroupResponse reply;
  };
  // The repeat of a taken key: its first reply, or ALREADY_EXISTS when
  // `digest` differs; nullopt for a key not taken.
  std::optional<absl::Status> Repeat(const v1::SubmitGroupRequest& group,
                                     const std::string& digest,
                                     v1::SubmitGroupResponse* reply) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Takes a measured group into the step (its rows copied in, planned), or
  // refuses it with nothing changed.
  absl::Status Take(const Tenant& tenant, const v1::SubmitGroupRequest& group,
                    const DecodedGroup& decoded, const v1::PlanRequest& rows,
                    v1::SubmitGroupResponse* reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `bytes` in --max_inflight_bytes, or RESOURCE_EXHAUSTED at once when they
  // do not fit (after committing what the planner holds back, when it holds
  // any, as an under-filled wave).
  absl::StatusOr<MemoryBudget::Hold> Reserve(const Tenant& tenant,
                                             int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues every rank's micro-batch of each wave for its receivers.
  void Commit(const std::vector<Wave>& waves)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `planned`'s rows for `cp_rank`, gathered from the step's rows into a
  // request of their own; once every CP or SP rank has gathered them, the
  // step's copy goes.
  v1::PackRequest Gather(Planned* planned, int cp_rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Packs a gathered request into a message (outside mu_: other ranks'
  // packing and every submit go on meanwhile).
  absl::StatusOr<Message> Pack(const Planned& planned,
                               const v1::PackRequest& request);
  // The step's rows of planner units (a unit is a row, or with a shared prefix
  // a group's rows), ascending.
  std::vector<int64_t> RowsOf(const std::vector<int64_t>& units) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The last message: every micro-batch sent, by rank, and the step's counts.
  v1::PlanResponse Summary() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes every listener (outside mu_).
  void WakeAll();
  void FailLocked(const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION once the step has ended, or (saying `closed`) once it
  // is closed; OK while it takes groups.
  absl::Status StillOpen(absl::string_view closed) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::string id_;
  const Tenant owner_;
  const v1::StepOptions options_;
  ServiceCore* const core_;
  MemoryBudget* const budget_;
  const int ranks_;
  const int cp_ranks_;
  const absl::Time deadline_;
  const absl::Time opened_ = absl::Now();
  // The layout shares each group's prompt: a group is one planning unit.
  const bool shared_;
  const Metrics::StepHeld held_;  // its series, gone with the step

  absl::Mutex mu_;
  StreamPlanner planner_ ABSL_GUARDED_BY(mu_);
  StreamRows rows_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StepListener> controller_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  // Micro-batches committed, by rank.
  std::vector<int> sent_ ABSL_GUARDED_BY(mu_);
  int64_t waves_before_close_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
  // Rows submitted and not packed, as counted in the metrics' gauge (given
  // back when the step ends).
  int64_t rows_pending_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Taken> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_SERVICE_STREAM_STEP_H_
