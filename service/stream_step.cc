#include "service/stream_step.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "proto/tensor_codec.h"
#include "service/step.h"

namespace packd {
namespace {

int64_t ItemBytes(v1::DType dtype) {
  v1::Tensor t;
  t.set_dtype(dtype);
  absl::StatusOr<TensorView> view = DecodeTensorHeader(t, "");
  return view.ok() ? ItemSize(view->dtype) : 0;
}

bool SameTail(const v1::Tensor& a, const v1::Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape_size() != b.shape_size()) return false;
  for (int i = 2; i < a.shape_size(); ++i) {
    if (a.shape(i) != b.shape(i)) return false;
  }
  return true;
}

}  // namespace

StreamingStep::StreamingStep(std::string id, const v1::StepOptions& options,
                             StreamPlanner planner, ServiceCore* core,
                             MemoryBudget* budget, int cp_ranks,
                             absl::Time deadline)
    : id_(std::move(id)),
      options_(options),
      core_(core),
      budget_(budget),
      ranks_(std::max(options.plan().num_ranks(), 1)),
      cp_ranks_(cp_ranks),
      deadline_(deadline),
      shared_(options.layout().has_shared_prefix()),
      planner_(std::move(planner)) {
  slots_.resize(static_cast<size_t>(ranks_) * cp_ranks_);
  sent_.resize(ranks_);
  core_->metrics().StreamSteps(1);
}

StreamingStep::~StreamingStep() {
  core_->metrics().StreamSteps(-1);
  core_->metrics().StreamRowsPending(-rows_pending_);
}

absl::Status StreamingStep::Submit(const Tenant& tenant,
                                   const v1::SubmitGroupRequest& group,
                                   v1::SubmitGroupResponse* reply) {
  const int64_t oldest = options_.policy_version() - options_.max_staleness();
  if (group.policy_version() < oldest) {
    return absl::FailedPreconditionError(
        absl::StrCat("the group's policy version ", group.policy_version(),
                     " is older than step ", id_, " allows (policy version ",
                     options_.policy_version(), ", max_staleness ",
                     options_.max_staleness(), ": at least ", oldest, ")"));
  }
  // Measured as PackMicroBatches measures a batch: the group's rows with the
  // step's layout, on the host.
  v1::PackMicroBatchesRequest request;
  v1::PackRequest* batch = request.mutable_batch();
  *batch = options_.layout();
  batch->set_device("cpu");
  *batch->mutable_mask() = group.mask();
  *batch->mutable_inputs() = group.inputs();
  if (group.has_segment_ids()) {
    *batch->mutable_segment_ids() = group.segment_ids();
  }
  if (group.has_loss_mask()) *request.mutable_loss_mask() = group.loss_mask();
  const int64_t g = group.mask().shape_size() > 0 ? group.mask().shape(0) : 0;
  if (shared_) {
    if (group.prefix_lengths_size() != g) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix_lengths has ", group.prefix_lengths_size(),
          " values; the layout shares each group's prompt, so it needs one "
          "per row of mask (",
          g, ")"));
    }
    v1::SharedPrefix* shared = batch->mutable_shared_prefix();
    shared->clear_groups();
    for (int64_t r = 0; r < g; ++r) shared->add_groups(0);
    *shared->mutable_prefix_lengths() = group.prefix_lengths();
  } else if (group.prefix_lengths_size() > 0) {
    return absl::InvalidArgumentError(
        "prefix_lengths must be empty: the step's layout has no shared_prefix");
  }
  *request.mutable_plan() = options_.plan();
  request.mutable_plan()->set_num_ranks(1);
  request.mutable_plan()->set_micro_batch_multiple(1);
  Wire<v1::PackMicroBatchesRequest> wire;
  wire.message() = std::move(request);
  absl::StatusOr<std::unique_ptr<TrainingStep>> measured = TrainingStep::Make(
      wire, core_->decoder(), core_->options().max_message_bytes, tenant);
  if (!measured.ok()) {
    return absl::Status(
        measured.status().code(),
        absl::StrCat("the group: ", measured.status().message()));
  }
  const v1::PlanRequest& rows = (*measured)->measured();

  std::vector<Wave> waves;
  {
    absl::MutexLock lock(&mu_);
    PACKD_RETURN_IF_ERROR(StillOpen("is closed: it takes no more groups"));
    if (!groups_.empty()) {
      bool same = group.inputs_size() == static_cast<int>(schema_.size()) &&
                  group.mask().dtype() == mask_dtype_ &&
                  group.has_segment_ids() == segment_dtype_.has_value() &&
                  (!group.has_segment_ids() ||
                   group.segment_ids().dtype() == *segment_dtype_);
      for (int i = 0; same && i < group.inputs_size(); ++i) {
        same = SameTail(group.inputs(i), schema_[i]);
      }
      if (!same) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the group's mask, segment ids and inputs must have the dtypes "
            "and tails of step ",
            id_, "'s first group (", schema_.size(),
            " inputs): every micro-batch packs rows of several groups"));
      }
    }
    Group kept;
    PACKD_RETURN_IF_ERROR(Keep(tenant, group, &kept));
    PACKD_ASSIGN_OR_RETURN(kept.held, Reserve(tenant, kept));
    if (groups_.empty()) {
      schema_.assign(group.inputs().begin(), group.inputs().end());
      for (v1::Tensor& t : schema_) t.clear_storage();
      mask_dtype_ = group.mask().dtype();
      if (group.has_segment_ids()) segment_dtype_ = group.segment_ids().dtype();
    }
    kept.first_row = rows_;
    kept.arrived = absl::Now();
    kept.unsent = g;
    rows_pending_ += g;
    core_->metrics().StreamRowsPending(g);
    const int64_t index = static_cast<int64_t>(groups_.size());
    std::vector<StreamUnit> units;
    if (shared_) {
      StreamUnit u{index, 0, 0, 0};
      for (int64_t r = 0; r < g; ++r) {
        u.length += rows.lengths(r);
        u.loss_tokens += rows.loss_tokens(r);
        u.cost += rows.costs(r);
      }
      units.push_back(u);
    } else {
      for (int64_t r = 0; r < g; ++r) {
        units.push_back(
            {rows_ + r, rows.lengths(r), rows.loss_tokens(r), rows.costs(r)});
      }
    }
    for (int64_t r = 0; r < g; ++r) sequences_ += rows.loss_tokens(r) > 0;
    groups_.push_back(std::move(kept));
    rows_ += g;
    for (const StreamUnit& u : units) {
      absl::StatusOr<std::vector<Wave>> more = planner_.Add(u);
      if (!more.ok()) {
        FailLocked(more.status());
        break;
      }
      for (Wave& w : *more) waves.push_back(std::move(w));
    }
    if (!failed_.has_value()) {
      absl::Status sent = Send(waves);
      if (!sent.ok()) FailLocked(sent);
    }
    reply->set_group(index);
    reply->set_first_row(groups_.back().first_row);
    reply->set_waves(planner_.waves());
  }
  WakeAll();
  return absl::OkStatus();
}

absl::Status StreamingStep::Keep(const Tenant& tenant,
                                 const v1::SubmitGroupRequest& group,
                                 Group* kept) {
  DecodedCall call;
  call.tenant = tenant;
  auto bytes = [&](const v1::Tensor& t, absl::string_view field,
                   std::string* out) -> absl::Status {
    if (t.has_data()) {
      *out = t.data();
      return absl::OkStatus();
    }
    PACKD_ASSIGN_OR_RETURN(TensorView view,
                           core_->decoder().DecodeTensor(t, field, &call));
    if (view.device.kind != DeviceKind::kCpu) {
      return absl::FailedPreconditionError(
          absl::StrCat(field,
                       " is in device memory: a streaming step's groups come "
                       "inline or in shared memory"));
    }
    out->assign(static_cast<const char*>(view.data),
                static_cast<size_t>(view.nbytes()));
    return absl::OkStatus();
  };
  kept->rows = group.mask().shape(0);
  kept->S = group.mask().shape(1);
  PACKD_RETURN_IF_ERROR(bytes(group.mask(), "mask", &kept->mask));
  kept->inputs.resize(group.inputs_size());
  for (int i = 0; i < group.inputs_size(); ++i) {
    PACKD_RETURN_IF_ERROR(bytes(
        group.inputs(i), absl::StrCat("inputs[", i, "]"), &kept->inputs[i]));
  }
  if (group.has_segment_ids()) {
    PACKD_RETURN_IF_ERROR(
        bytes(group.segment_ids(), "segment_ids", &kept->segment_ids));
  }
  kept->prefix_lengths.assign(group.prefix_lengths().begin(),
                              group.prefix_lengths().end());
  return absl::OkStatus();
}

absl::StatusOr<MemoryBudget::Hold> StreamingStep::Reserve(const Tenant& tenant,
                                                          const Group& kept) {
  int64_t bytes =
      static_cast<int64_t>(kept.mask.size() + kept.segment_ids.size());
  for (const std::string& input : kept.inputs) {
    bytes += static_cast<int64_t>(input.size());
  }
  absl::Mutex mu;
  bool done = false;
  absl::StatusOr<MemoryBudget::Hold> got;
  // No wait: a group that does not fit now is refused, and the step goes on.
  budget_->Reserve(
      bytes, absl::Now(),
      [&](absl::StatusOr<MemoryBudget::Hold> hold) {
        absl::MutexLock lock(&mu);
        got = std::move(hold);
        done = true;
      },
      /*first=*/false, tenant.name);
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(&done));
  if (!got.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the group's ", bytes, " bytes do not fit --max_inflight_bytes (",
        budget_->in_use(), " of ", budget_->limit(), " in use; step ", id_,
        " holds its groups until their rows are sent): ",
        got.status().message()));
  }
  return got;
}

void StreamingStep::RowsOf(int64_t unit, std::vector<int64_t>* rows) const {
  if (!shared_) {
    rows->push_back(unit);
    return;
  }
  const Group& g = groups_[unit];
  for (int64_t r = 0; r < g.rows; ++r) rows->push_back(g.first_row + r);
}

v1::PackRequest StreamingStep::RowsRequest(const std::vector<int64_t>& rows,
                                           int cp_rank) const {
  v1::PackRequest request = options_.layout();
  if (request.cp_size() > 1) request.set_cp_rank(cp_rank);
  if (request.sp_size() > 1) request.set_sp_rank(cp_rank);
  // The group of each row (groups_ is in row order).
  std::vector<const Group*> of;
  int64_t S = 1;
  for (int64_t row : rows) {
    auto it = std::upper_bound(
        groups_.begin(), groups_.end(), row,
        [](int64_t r, const Group& g) { return r < g.first_row; });
    of.push_back(&*(it - 1));
    S = std::max(S, of.back()->S);
  }
  const int64_t B = static_cast<int64_t>(rows.size());
  // Each row's S_g positions, then zeros (inactive) up to S.
  auto gather = [&](v1::Tensor* out, v1::DType dtype,
                    const std::vector<int64_t>& tail,
                    const std::string Group::*field, int input) {
    out->set_dtype(dtype);
    out->add_shape(B);
    out->add_shape(S);
    int64_t position = ItemBytes(dtype);
    for (int64_t d : tail) {
      out->add_shape(d);
      position *= d;
    }
    std::string* data = out->mutable_data();
    data->assign(static_cast<size_t>(B * S * position), '\0');
    for (int64_t j = 0; j < B; ++j) {
      const Group& g = *of[j];
      const std::string& src = input < 0 ? g.*field : g.inputs[input];
      const int64_t row_bytes = g.S * position;
      std::memcpy(data->data() + j * S * position,
                  src.data() + (rows[j] - g.first_row) * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  };
  gather(request.mutable_mask(), mask_dtype_, {}, &Group::mask, -1);
  for (size_t i = 0; i < schema_.size(); ++i) {
    std::vector<int64_t> tail(schema_[i].shape().begin() + 2,
                              schema_[i].shape().end());
    gather(request.add_inputs(), schema_[i].dtype(), tail, nullptr,
           static_cast<int>(i));
  }
  if (segment_dtype_.has_value()) {
    gather(request.mutable_segment_ids(), *segment_dtype_, {},
           &Group::segment_ids, -1);
  }
  if (shared_) {
    v1::SharedPrefix* shared = request.mutable_shared_prefix();
    shared->clear_groups();
    shared->clear_prefix_lengths();
    for (int64_t j = 0; j < B; ++j) {
      shared->add_groups(of[j] - groups_.data());
      shared->add_prefix_lengths(
          of[j]->prefix_lengths[rows[j] - of[j]->first_row]);
    }
  }
  return request;
}

absl::Status StreamingStep::Send(const std::vector<Wave>& waves) {
  for (const Wave& wave : waves) {
    core_->metrics().StreamWave();
    for (const MicroBatch& m : wave.micro_batches) {
      std::vector<int64_t> rows;
      for (int64_t unit : m.samples) RowsOf(unit, &rows);
      std::sort(rows.begin(), rows.end());
      const int index = static_cast<int>(sent_[m.rank].size());
      v1::MicroBatch planned;
      planned.set_rank(m.rank);
      for (int64_t row : rows) planned.add_samples(row);
      planned.set_tokens(m.tokens);
      planned.set_loss_tokens(m.loss_tokens);
      planned.set_cost(m.cost);
      planned.set_padded_tokens(m.padded_tokens);
      sent_[m.rank].push_back(planned);
      for (int cp = 0; cp < cp_ranks_; ++cp) {
        auto message = std::make_shared<v1::PackMicroBatchesResponse>();
        message->set_rank(m.rank);
        message->set_index(index);
        *message->mutable_samples() = planned.samples();
        PACKD_RETURN_IF_ERROR(
            core_->DoPack(RowsRequest(rows, cp), message->mutable_packed()));
        slots_[m.rank * cp_ranks_ + cp].queue.push_back(std::move(message));
      }
      const absl::Time now = absl::Now();
      const Group* last = nullptr;
      for (int64_t row : rows) {
        auto it = std::upper_bound(
            groups_.begin(), groups_.end(), row,
            [](int64_t r, const Group& g) { return r < g.first_row; });
        Group& g = *(it - 1);
        if (&g != last) core_->metrics().StreamGroupSent(now - g.arrived);
        last = &g;
        if (--g.unsent == 0) {  // every row sent: its bytes go
          g.mask = g.segment_ids = std::string();
          g.inputs.clear();
          g.held.reset();
        }
      }
      rows_pending_ -= static_cast<int64_t>(rows.size());
      core_->metrics().StreamRowsPending(-static_cast<int64_t>(rows.size()));
    }
  }
  return absl::OkStatus();
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
  if (slot.attached) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", rank, " (cp_rank ", cp_rank,
                     ") already has a receiving stream for step ", id_));
  }
  slot.attached = true;
  slot.listener = std::move(listener);
  return rank * cp_ranks_ + cp_rank;
}

StreamingStep::Message StreamingStep::Next(int slot,
                                           std::optional<absl::Status>* end) {
  absl::MutexLock lock(&mu_);
  if (failed_.has_value()) {
    *end = *failed_;
    return nullptr;
  }
  Slot& s = slots_[slot];
  if (!s.queue.empty()) {
    Message m = std::move(s.queue.front());
    s.queue.pop_front();
    return m;
  }
  if (s.last_queued) *end = absl::OkStatus();
  return nullptr;
}

void StreamingStep::Detach(int slot, bool after_last) {
  bool all_sent = true;
  {
    absl::MutexLock lock(&mu_);
    Slot& s = slots_[slot];
    s.listener = nullptr;
    if (after_last && !failed_.has_value()) {
      s.last_sent = true;
    } else if (!failed_.has_value()) {
      FailLocked(absl::UnavailableError(absl::StrCat(
          "rank ", slot / cp_ranks_,
          cp_ranks_ > 1 ? absl::StrCat(" (cp_rank ", slot % cp_ranks_, ")")
                        : "",
          "'s receiving stream ended before step ", id_, " did")));
    }
    for (const Slot& other : slots_) all_sent = all_sent && other.last_sent;
  }
  WakeAll();
  (void)all_sent;
}

absl::Status StreamingStep::Close() {
  {
    absl::MutexLock lock(&mu_);
    PACKD_RETURN_IF_ERROR(StillOpen("is closed already"));
    closed_ = true;
    waves_before_close_ = planner_.waves();
    absl::StatusOr<std::vector<Wave>> rest = planner_.Close();
    absl::Status sent = rest.ok() ? Send(*rest) : rest.status();
    if (!sent.ok()) {
      FailLocked(sent);
    } else {
      auto last = std::make_shared<v1::PackMicroBatchesResponse>();
      v1::PlanResponse* plan = last->mutable_plan();
      const int64_t per_rank = planner_.waves();
      plan->set_micro_batches_per_rank(per_rank);
      plan->set_global_loss_tokens(planner_.loss_tokens());
      plan->set_global_sequences(sequences_);
      double most_tokens = 0, all_tokens = 0, most_cost = 0, all_cost = 0;
      for (const std::vector<v1::MicroBatch>& rank : sent_) {
        double tokens = 0, cost = 0;
        for (const v1::MicroBatch& m : rank) {
          *plan->add_micro_batches() = m;
          tokens += m.tokens();
          cost += m.cost();
        }
        most_tokens = std::max(most_tokens, tokens);
        most_cost = std::max(most_cost, cost);
        all_tokens += tokens;
        all_cost += cost;
      }
      plan->set_imbalance(all_tokens > 0 ? most_tokens * ranks_ / all_tokens
                                         : 1.0);
      plan->set_cost_imbalance(all_cost > 0 ? most_cost * ranks_ / all_cost
                                            : 1.0);
      for (Slot& s : slots_) {
        s.queue.push_back(last);
        s.last_queued = true;
      }
    }
  }
  WakeAll();
  return absl::OkStatus();
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

void StreamingStep::FailLocked(const absl::Status& status) {
  if (!failed_.has_value()) failed_ = status;
  groups_.clear();
  groups_.shrink_to_fit();
  for (Slot& s : slots_) s.queue.clear();
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
    if (!s.last_sent) return std::nullopt;
  }
  summary->set_step_id(id_);
  summary->set_closed(true);
  summary->set_groups(static_cast<int64_t>(groups_.size()));
  summary->set_rows(rows_);
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

StepRegistry::StepRegistry(ServiceCore* core, MemoryBudget* budget)
    : core_(core), budget_(budget) {
  reaper_ = std::thread([this] { Reap(); });
}

StepRegistry::~StepRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  reaper_.join();
}

void StepRegistry::SetAddress(std::string address) {
  absl::MutexLock lock(&mu_);
  address_ = std::move(address);
}

std::string StepRegistry::address() const {
  absl::MutexLock lock(&mu_);
  return address_;
}

absl::StatusOr<std::shared_ptr<StreamingStep>> StepRegistry::Open(
    const v1::StepOptions& options) {
  const v1::PackRequest& layout = options.layout();
  if (layout.has_mask() || layout.inputs_size() > 0 ||
      layout.has_segment_ids() || layout.outputs_size() > 0) {
    return absl::InvalidArgumentError(
        "open.layout must hold no tensors or outputs: each group brings its "
        "tensors, and micro-batches come back inline");
  }
  if (layout.cp_rank() != 0 || layout.sp_rank() != 0) {
    return absl::InvalidArgumentError(
        "open.layout.cp_rank and sp_rank must be 0: each receiver names its "
        "own");
  }
  if (layout.has_mrope()) {
    return absl::InvalidArgumentError(
        "open.layout.mrope is not taken by a streaming step: use "
        "PackMicroBatches for multimodal batches");
  }
  if (layout.has_shared_prefix() &&
      (layout.shared_prefix().groups_size() > 0 ||
       layout.shared_prefix().prefix_lengths_size() > 0)) {
    return absl::InvalidArgumentError(
        "open.layout.shared_prefix takes only same_inputs: each group brings "
        "its prefix lengths");
  }
  const v1::PlanRequest& plan = options.plan();
  if (plan.lengths_size() > 0 || plan.loss_tokens_size() > 0 ||
      plan.costs_size() > 0 || plan.groups_size() > 0 ||
      plan.pad_multiple() != 0 || plan.pipeline_order()) {
    return absl::InvalidArgumentError(
        "open.plan takes the budget, num_ranks, micro_batch_multiple and the "
        "cost model only: packd measures each group, a group is one unit "
        "where it shares a prompt, and pipeline order needs the whole batch");
  }
  if (options.max_staleness() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("open.max_staleness is ",
                                                   options.max_staleness(),
                                                   "; it must be >= 0"));
  }
  const int cp = std::max({layout.cp_size(), layout.sp_size(), 1});
  StreamPlanner::Options planner;
  planner.plan.max_tokens_per_micro_batch = plan.max_tokens_per_micro_batch();
  planner.plan.num_ranks = plan.num_ranks();
  planner.plan.micro_batch_multiple = plan.micro_batch_multiple();
  planner.plan.cost_per_token = plan.cost_per_token();
  planner.plan.cost_per_token_squared = plan.cost_per_token_squared();
  if (options.wave_fill() != 0) planner.fill = options.wave_fill();
  // The reserve balances ranks at the close: one rank has nothing to balance.
  planner.reserve = options.has_reserve()  ? options.reserve()
                    : plan.num_ranks() > 1 ? 1.0
                                           : 0.0;
  absl::StatusOr<StreamPlanner> made = StreamPlanner::Make(planner);
  if (!made.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("open: ", made.status().message()));
  }
  const absl::Time deadline =
      absl::Now() + absl::Seconds(options.timeout_seconds() > 0
                                      ? options.timeout_seconds()
                                      : 3600);
  absl::MutexLock lock(&mu_);
  std::string id = options.step_id();
  if (id.empty()) {
    do {
      id =
          absl::StrCat("step-", absl::ToUnixMicros(absl::Now()), "-", ++named_);
    } while (steps_.contains(id));
  }
  if (steps_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "step ", id, " is open already: another controller holds it"));
  }
  auto step = std::make_shared<StreamingStep>(id, options, *std::move(made),
                                              core_, budget_, cp, deadline);
  steps_[id] = step;
  return step;
}

absl::StatusOr<std::shared_ptr<StreamingStep>> StepRegistry::Find(
    const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(id);
  if (it == steps_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no step ", id, " is open on this replica (", address_,
                     "): call the address its controller was given"));
  }
  return it->second;
}

void StepRegistry::Remove(const std::string& id) {
  std::shared_ptr<StreamingStep> gone;
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(id);
  if (it == steps_.end()) return;
  gone = std::move(it->second);
  steps_.erase(it);
}

void StepRegistry::EndAll() {
  absl::flat_hash_map<std::string, std::shared_ptr<StreamingStep>> steps;
  {
    absl::MutexLock lock(&mu_);
    steps.swap(steps_);
  }
  for (const auto& [id, step] : steps) {
    step->Fail(absl::UnavailableError(
        absl::StrCat("packd is shutting down: step ", id, " ends")));
  }
}

int64_t StepRegistry::open_steps() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(steps_.size());
}

void StepRegistry::Reap() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200));
    std::vector<std::shared_ptr<StreamingStep>> late;
    const absl::Time now = absl::Now();
    for (const auto& [id, step] : steps_) {
      if (step->deadline() < now) late.push_back(step);
    }
    if (late.empty()) continue;
    mu_.Unlock();
    for (const auto& step : late) {
      step->Fail(absl::DeadlineExceededError(
          absl::StrCat("step ", step->id(), " passed its timeout_seconds")));
    }
    mu_.Lock();
  }
}

}  // namespace packd
