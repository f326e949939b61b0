#include "service/step_registry.h"

#include <openssl/rand.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "proto/plan_codec.h"
#include "service/step_parts.h"

namespace packd {
namespace {

// "step-" and 128 bits from OpenSSL's generator, in hex.
absl::StatusOr<std::string> RandomStepId() {
  unsigned char bits[16];
  if (RAND_bytes(bits, sizeof(bits)) != 1) {
    return absl::InternalError(
        "the random generator failed to name a step; give open.step_id");
  }
  return absl::StrCat("step-",
                      absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(bits), sizeof(bits))));
}

}  // namespace

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
    const Tenant& owner, const v1::StepOptions& options) {
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
  if (options.max_staleness() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("open.max_staleness is ",
                                                   options.max_staleness(),
                                                   "; it must be >= 0"));
  }
  // The plan's options, checked once each: what the wire form adds (lengths,
  // loss tokens, costs, padding, the cost model) as PackMicroBatches checks
  // them, and the streamed plan's own (its budget, ranks, groups, pipeline
  // order, reserve and fill) by StreamPlanner::Make below.
  {
    v1::PackMicroBatchesRequest step;
    *step.mutable_plan() = plan;
    if (absl::Status checked = CheckStepRequest(step); !checked.ok()) {
      return absl::Status(checked.code(),
                          absl::StrCat("open.", checked.message()));
    }
  }
  const int cp = std::max({layout.cp_size(), layout.sp_size(), 1});
  StreamPlanner::Options planner;
  planner.plan = PlanOptionsOf(plan);
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
  for (const std::string& name : options.submitters()) {
    if (name.empty()) {
      return absl::InvalidArgumentError(
          "open.submitters names an empty tenant");
    }
  }
  absl::MutexLock lock(&mu_);
  std::string id = options.step_id();
  if (id.empty()) {
    do {
      PACKD_ASSIGN_OR_RETURN(id, RandomStepId());
    } while (steps_.contains({owner.name, id}));
  }
  if (steps_.contains({owner.name, id})) {
    return absl::AlreadyExistsError(absl::StrCat(
        "step ", id, " is open already: another controller holds it"));
  }
  auto step = std::make_shared<StreamingStep>(
      id, owner, options, *std::move(made), core_, budget_, cp, deadline);
  steps_[{owner.name, id}] = step;
  return step;
}

absl::StatusOr<std::shared_ptr<StreamingStep>> StepRegistry::Find(
    const Tenant& caller, const std::string& id, StepAccess access) const {
  absl::MutexLock lock(&mu_);
  auto it = steps_.find({caller.name, id});
  if (it != steps_.end()) return it->second;
  if (access == StepAccess::kSubmit) {
    // A step of another tenant that named the caller a submitter: the one
    // opened first when several did (steps_ is unordered; ids are random
    // unless their controllers chose them).
    std::shared_ptr<StreamingStep> found;
    for (const auto& [key, step] : steps_) {
      if (key.second == id && step->TakesGroupsFrom(caller) &&
          (found == nullptr || step->opened() < found->opened())) {
        found = step;
      }
    }
    if (found != nullptr) return found;
  }
  // The same answer for a step of another tenant as for none: no oracle of
  // other tenants' steps.
  return absl::NotFoundError(
      absl::StrCat("no step ", id, " is open on this replica (", address_,
                   "): call the address its controller was given"));
}

void StepRegistry::Remove(const StreamingStep& step) {
  std::shared_ptr<StreamingStep> gone;
  absl::MutexLock lock(&mu_);
  auto it = steps_.find({step.owner().name, step.id()});
  if (it == steps_.end() || it->second.get() != &step) return;
  gone = std::move(it->second);
  steps_.erase(it);
}

void StepRegistry::EndAll() {
  absl::flat_hash_map<std::pair<std::string, std::string>,
                      std::shared_ptr<StreamingStep>>
      steps;
  {
    absl::MutexLock lock(&mu_);
    steps.swap(steps_);
  }
  for (const auto& [key, step] : steps) {
    step->Fail(absl::UnavailableError(
        absl::StrCat("packd is shutting down: step ", key.second, " ends")));
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
    for (const auto& [key, step] : steps_) {
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
