#include "service/stream_step.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"

namespace packd {

StreamingStep::StreamingStep(std::string id, Tenant owner,
                             const v1::StepOptions& options,
                             StreamPlanner planner, ServiceCore* core,
                             MemoryBudget* budget, int cp_ranks,
                             absl::Time deadline)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      options_(options),
      core_(core),
      budget_(budget),
      ranks_(std::max(options.plan().num_ranks(), 1)),
      cp_ranks_(cp_ranks),
      deadline_(deadline),
      shared_(options.layout().has_shared_prefix()),
      held_(core->metrics().AddStepHeld(owner_.name, id_)),
      planner_(std::move(planner)),
      rows_(held_.groups) {
  slots_.resize(static_cast<size_t>(ranks_) * cp_ranks_);
  sent_.resize(ranks_);
  core_->metrics().StreamSteps(1);
}

StreamingStep::~StreamingStep() {
  core_->metrics().StreamSteps(-1);
  core_->metrics().StreamRowsPending(-rows_pending_);
  core_->metrics().RemoveStepHeld(held_);
}

bool StreamingStep::TakesGroupsFrom(const Tenant& tenant) const {
  if (tenant == owner_) return true;
  for (const std::string& name : options_.submitters()) {
    if (name == tenant.name) return true;
  }
  return false;
}

absl::Status StreamingStep::Submit(const Tenant& tenant,
                                   const v1::SubmitGroupRequest& group,
                                   v1::SubmitGroupResponse* reply) {
  const std::string digest =
      group.group_key().empty() ? std::string() : GroupDigest(group);
  {
    absl::MutexLock lock(&mu_);
    if (std::optional<absl::Status> repeat = Repeat(group, digest, reply)) {
      return *repeat;
    }
  }
  const int64_t oldest = options_.policy_version() - options_.max_staleness();
  if (group.policy_version() < oldest) {
    return absl::FailedPreconditionError(
        absl::StrCat("the group's policy version ", group.policy_version(),
                     " is older than step ", id_, " allows (policy version ",
                     options_.policy_version(), ", max_staleness ",
                     options_.max_staleness(), ": at least ", oldest, ")"));
  }
  PACKD_ASSIGN_OR_RETURN(const DecodedGroup decoded,
                         DecodeGroup(core_->decoder(), tenant, group));
  PACKD_ASSIGN_OR_RETURN(
      const v1::PlanRequest rows,
      MeasureGroup(options_, group, decoded, core_->options().max_message_bytes,
                   tenant));
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    // A repeat that raced the first submit of its key.
    if (std::optional<absl::Status> repeat = Repeat(group, digest, reply)) {
      return *repeat;
    }
    status = Take(tenant, group, decoded, rows, reply);
    if (status.ok() && !group.group_key().empty()) {
      keys_[group.group_key()] = Taken{digest, *reply};
    }
  }
  WakeAll();  // the waves it let commit, or the under-filled one
  return status;
}

absl::Status StreamingStep::Take(const Tenant& tenant,
                                 const v1::SubmitGroupRequest& group,
                                 const DecodedGroup& decoded,
                                 const v1::PlanRequest& rows,
                                 v1::SubmitGroupResponse* reply) {
  PACKD_RETURN_IF_ERROR(StillOpen("is closed: it takes no more groups"));
  PACKD_RETURN_IF_ERROR(rows_.CheckSchema(decoded.call));
  const int64_t g = decoded.call.mask.shape[0];
  PACKD_ASSIGN_OR_RETURN(
      MemoryBudget::Hold held,
      Reserve(tenant, StreamRows::RowBytes(decoded.call) * g));
  const int64_t index = rows_.groups();
  const int64_t first =
      rows_.Add(decoded.call,
                std::vector<int64_t>(group.prefix_lengths().begin(),
                                     group.prefix_lengths().end()),
                std::move(held));
  rows_pending_ += g;
  core_->metrics().StreamRowsPending(g);
  for (int64_t r = 0; r < g; ++r) sequences_ += rows.loss_tokens(r) > 0;
  std::vector<Wave> waves;
  for (const StreamUnit& u : PlanningUnits(rows, first, index, shared_)) {
    absl::StatusOr<std::vector<Wave>> more = planner_.Add(u);
    if (!more.ok()) {
      FailLocked(more.status());
      return more.status();
    }
    for (Wave& w : *more) waves.push_back(std::move(w));
  }
  Commit(waves);
  reply->set_group(index);
  reply->set_first_row(first);
  reply->set_waves(planner_.waves());
  return absl::OkStatus();
}

absl::StatusOr<MemoryBudget::Hold> StreamingStep::Reserve(const Tenant& tenant,
                                                          int64_t bytes) {
  absl::StatusOr<MemoryBudget::Hold> got =
      budget_->TryReserve(bytes, tenant.name);
  if (got.ok()) return got;
  // Rows the planner holds back (the close's reserve, rows too short to fill
  // a wave) must never pin the budget: they go out as an under-filled wave,
  // and their bytes come back once the ranks have read it.
  std::string made_room;
  Wave wave;
  if (bytes <= budget_->share() && planner_.CommitUnderFilled(&wave)) {
    size_t units = 0;
    for (const MicroBatch& m : wave.micro_batches) units += m.samples.size();
    Commit({std::move(wave)});
    made_room = absl::StrCat("; step ", id_, " sent ", units,
                             shared_ ? " groups" : " rows",
                             " it held back as an under-filled wave to make "
                             "room: retry once its ranks have read it");
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the group's ", bytes, " bytes do not fit --max_inflight_bytes now (",
      got.status().message(), "; step ", id_,
      " holds a group's rows until its ranks' streams have taken them)",
      made_room));
}

void StreamingStep::Commit(const std::vector<Wave>& waves) {
  for (const Wave& wave : waves) {
    core_->metrics().StreamWave();
    for (const MicroBatch& m : wave.micro_batches) {
      auto planned = std::make_shared<Planned>();
      planned->batch = m;
      planned->batch.samples = RowsOf(m.samples);
      planned->index = static_cast<int>(sent_[m.rank]++);
      planned->unpacked = cp_ranks_;
      for (int cp = 0; cp < cp_ranks_; ++cp) {
        slots_[m.rank * cp_ranks_ + cp].planned.push_back(planned);
      }
    }
  }
}

v1::PackRequest StreamingStep::Gather(Planned* planned, int cp_rank) {
  const std::vector<int64_t>& rows = planned->batch.samples;
  v1::PackRequest request = rows_.Request(options_.layout(), rows, cp_rank);
  if (--planned->unpacked == 0) {  // every CP or SP rank has its copy
    rows_.Release(rows, &core_->metrics());
    rows_pending_ -= static_cast<int64_t>(rows.size());
    core_->metrics().StreamRowsPending(-static_cast<int64_t>(rows.size()));
  }
  return request;
}

absl::StatusOr<StreamingStep::Message> StreamingStep::Pack(
    const Planned& planned, const v1::PackRequest& request) {
  const std::vector<int64_t>& rows = planned.batch.samples;
  auto out = std::make_shared<Outgoing>();
  v1::PackMicroBatchesResponse& message = out->response;
  message.set_rank(planned.batch.rank);
  message.set_index(planned.index);
  message.mutable_samples()->Assign(rows.begin(), rows.end());
  PACKD_RETURN_IF_ERROR(core_->DoPack(request, message.mutable_packed()));
  // The layout the rank reads its results with (no tensors).
  v1::PackRequest* layout = message.mutable_layout();
  *layout = options_.layout();
  layout->set_cp_rank(request.cp_rank());
  layout->set_sp_rank(request.sp_rank());
  // The rows' bytes change form: from the request into the message, until
  // its stream has taken it.
  out->bytes = static_cast<int64_t>(message.ByteSizeLong());
  out->held = budget_->Charge(out->bytes, owner_.name);
  out->gauge = held_.micro_batches;
  out->gauge->Increment(static_cast<double>(out->bytes));
  return Message(std::move(out));
}

StreamingStep::Message StreamingStep::Next(int slot,
                                           std::optional<absl::Status>* end) {
  std::shared_ptr<Planned> planned;
  v1::PackRequest request;
  MemoryBudget::Hold gathered;  // the request's bytes, while it is packed
  {
    absl::MutexLock lock(&mu_);
    if (failed_.has_value()) {
      *end = *failed_;
      return nullptr;
    }
    Slot& s = slots_[slot];
    if (s.planned.empty()) {
      if (s.last != nullptr && s.state == SlotState::kReceiving) {
        s.state = SlotState::kLastGiven;
        return s.last;
      }
      if (s.state >= SlotState::kLastGiven) *end = absl::OkStatus();
      return nullptr;
    }
    planned = std::move(s.planned.front());
    s.planned.pop_front();
    request = Gather(planned.get(), slot % cp_ranks_);
    gathered = budget_->Charge(static_cast<int64_t>(request.ByteSizeLong()),
                               owner_.name);
  }
  // Packed outside the lock. A failure of the step meanwhile reaches this
  // stream at its next call; this micro-batch's bytes go with the message.
  absl::StatusOr<Message> packed = Pack(*planned, request);
  if (packed.ok()) return *std::move(packed);
  absl::MutexLock lock(&mu_);
  FailLocked(packed.status());
  *end = *failed_;
  return nullptr;
}

absl::Status StreamingStep::Close() {
  {
    absl::MutexLock lock(&mu_);
    PACKD_RETURN_IF_ERROR(StillOpen("is closed already"));
    closed_ = true;
    waves_before_close_ = planner_.waves();
    absl::StatusOr<std::vector<Wave>> rest = planner_.Close();
    if (!rest.ok()) {
      FailLocked(rest.status());
    } else {
      Commit(*rest);
      auto last = std::make_shared<Outgoing>();
      *last->response.mutable_plan() = Summary();
      for (Slot& s : slots_) s.last = last;
    }
  }
  WakeAll();
  return absl::OkStatus();
}

v1::PlanResponse StreamingStep::Summary() const {
  Plan plan = planner_.plan();
  for (MicroBatch& m : plan.micro_batches) m.samples = RowsOf(m.samples);
  plan.global_sequences = sequences_;
  v1::PlanResponse response;
  EncodePlan(plan, &response);
  return response;
}

void StreamingStep::FailLocked(const absl::Status& status) {
  if (!failed_.has_value()) failed_ = status;
  rows_.Clear();
  for (Slot& s : slots_) {
    s.planned.clear();
    s.last = nullptr;
  }
}

std::optional<absl::Status> StreamingStep::Repeat(
    const v1::SubmitGroupRequest& group, const std::string& digest,
    v1::SubmitGroupResponse* reply) const {
  if (group.group_key().empty()) return std::nullopt;
  auto it = keys_.find(group.group_key());
  if (it == keys_.end()) return std::nullopt;
  if (it->second.digest != digest) {
    return absl::AlreadyExistsError(absl::StrCat(
        "group_key \"", group.group_key(), "\" was taken by step ", id_,
        " for a group with other content (group ", it->second.reply.group(),
        "): a key names one group; give each group its own"));
  }
  *reply = it->second.reply;
  return absl::OkStatus();
}

std::vector<int64_t> StreamingStep::RowsOf(
    const std::vector<int64_t>& units) const {
  std::vector<int64_t> rows;
  for (int64_t unit : units) {
    if (!shared_) {
      rows.push_back(unit);
      continue;
    }
    const int64_t first = rows_.first_row(unit);
    for (int64_t r = 0; r < rows_.size(unit); ++r) rows.push_back(first + r);
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

absl::StatusOr<int> StreamingStep::Attach(
    int rank, int cp_rank, std::shared_ptr<StepListener> listener) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= ranks_ || cp_rank < 0 || cp_rank >= cp_ranks_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " (cp_rank ", cp_rank, ") is not in step ", id_,
        ": it has ", ranks_, " ranks of ", cp_ranks_, " CP or SP ranks each"));
  }
  if (failed_.has_value()) return *failed_;
  Slot& slot = slots_[rank * cp_ranks_ + cp_rank];
  if (slot.state != SlotState::kUnattached) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", rank, " (cp_rank ", cp_rank,
                     ") already has a receiving stream for step ", id_));
  }
  slot.state = SlotState::kReceiving;
  slot.listener = std::move(listener);
  return rank * cp_ranks_ + cp_rank;
}

void StreamingStep::Detach(int slot, bool after_last) {
  {
    absl::MutexLock lock(&mu_);
    Slot& s = slots_[slot];
    s.listener = nullptr;
    if (after_last && !failed_.has_value()) {
      s.state = SlotState::kLastSent;
    } else if (!failed_.has_value()) {
      FailLocked(absl::UnavailableError(absl::StrCat(
          "rank ", slot / cp_ranks_,
          cp_ranks_ > 1 ? absl::StrCat(" (cp_rank ", slot % cp_ranks_, ")")
                        : "",
          "'s receiving stream ended before step ", id_, " did")));
    }
  }
  WakeAll();
}

absl::Status StreamingStep::StillOpen(absl::string_view closed) const {
  if (failed_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id_, " has ended: ", failed_->message()));
  }
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id_, " ", closed));
  }
  return absl::OkStatus();
}

void StreamingStep::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    FailLocked(status);
  }
  WakeAll();
}

void StreamingStep::SetController(std::shared_ptr<StepListener> controller) {
  absl::MutexLock lock(&mu_);
  controller_ = std::move(controller);
}

std::optional<absl::Status> StreamingStep::Outcome(v1::StepEvent* summary) {
  absl::MutexLock lock(&mu_);
  if (failed_.has_value()) return *failed_;
  for (const Slot& s : slots_) {
    if (s.state != SlotState::kLastSent) return std::nullopt;
  }
  summary->set_step_id(id_);
  summary->set_closed(true);
  summary->set_groups(rows_.groups());
  summary->set_rows(rows_.rows());
  summary->set_waves(waves_before_close_);
  summary->set_micro_batches_per_rank(planner_.waves());
  summary->set_global_loss_tokens(planner_.loss_tokens());
  summary->set_global_sequences(sequences_);
  return absl::OkStatus();
}

void StreamingStep::WakeAll() {
  std::vector<std::shared_ptr<StepListener>> listeners;
  {
    absl::MutexLock lock(&mu_);
    for (const Slot& s : slots_) {
      if (s.listener != nullptr) listeners.push_back(s.listener);
    }
    if (controller_ != nullptr) listeners.push_back(controller_);
  }
  for (const auto& l : listeners) l->Wake();
}

}  // namespace packd
