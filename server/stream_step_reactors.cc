#include "server/stream_step_reactors.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/tsan.h"
#include "proto/tensor_codec.h"

namespace packd {

OpenStepReactor::OpenStepReactor(RpcRunner* calls, StepRegistry* steps,
                                 grpc::CallbackServerContext* context)
    : calls_(calls), steps_(steps) {
  absl::StatusOr<Tenant> admitted = calls_->Admit(*context, Draining::kRefused);
  if (!admitted.ok()) {
    absl::MutexLock lock(&mu_);
    EndLocked(admitted.status());
    return;
  }
  admitted_ = true;
  tenant_ = *std::move(admitted);
  listener_ = std::make_shared<StepListener>([this] { Wake(); });
  StartRead(&control_);
}

void OpenStepReactor::OnReadDone(bool ok) {
  std::shared_ptr<StreamingStep> step;
  Phase phase;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kFinished) return;
    step = step_;
    phase = phase_;
  }
  if (!ok) {
    if (phase == Phase::kAwaitingOpen) {
      absl::MutexLock lock(&mu_);
      EndLocked(absl::InvalidArgumentError(
          "the controller's stream ended before it opened a step"));
    } else if (phase == Phase::kOpen) {
      step->Fail(absl::CancelledError(absl::StrCat(
          "step ", step->id(),
          "'s controller stream ended before it closed the step")));
    }
    // After the close, the stream's end is the controller waiting for the
    // summary.
    return;
  }
  if (control_.has_open()) {
    if (step != nullptr) {
      step->Fail(absl::InvalidArgumentError(absl::StrCat(
          "step ", step->id(), " was opened twice on one stream")));
      return;
    }
    absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
        steps_->Open(tenant_, control_.open());
    absl::MutexLock lock(&mu_);
    if (!opened.ok()) {
      EndLocked(opened.status());
      return;
    }
    step_ = *opened;
    phase_ = Phase::kOpen;
    step_->SetController(listener_);
    opened_.set_step_id(step_->id());
    opened_.set_address(steps_->address());
    writing_ = true;
    StartWrite(&opened_);
    StartRead(&control_);
    return;
  }
  if (control_.has_close()) {
    if (step == nullptr) {
      absl::MutexLock lock(&mu_);
      EndLocked(absl::InvalidArgumentError("close came before open"));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (phase_ == Phase::kOpen) phase_ = Phase::kClosing;
    }
    const absl::Status closed = step->Close();
    if (!closed.ok()) {
      absl::MutexLock lock(&mu_);
      EndLocked(closed);
      return;
    }
    StartRead(&control_);
    return;
  }
  const absl::Status bad = absl::InvalidArgumentError(
      "a StepControl message must hold open or close");
  if (step != nullptr) {
    step->Fail(bad);
  } else {
    absl::MutexLock lock(&mu_);
    EndLocked(bad);
  }
}

void OpenStepReactor::Wake() {
  std::shared_ptr<StreamingStep> step;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kAwaitingOpen || phase_ >= Phase::kSummaryReady) {
      return;
    }
    step = step_;
  }
  v1::StepEvent summary;
  const std::optional<absl::Status> outcome = step->Outcome(&summary);
  if (!outcome.has_value()) return;
  absl::MutexLock lock(&mu_);
  if (phase_ >= Phase::kSummaryReady) return;
  if (!outcome->ok()) {
    EndLocked(*outcome);
    return;
  }
  summary.set_address(steps_->address());
  summary_ = summary;
  phase_ = Phase::kSummaryReady;
  WriteSummaryLocked();
}

void OpenStepReactor::WriteSummaryLocked() {
  if (writing_ || phase_ != Phase::kSummaryReady) return;
  writing_ = true;
  phase_ = Phase::kSummaryWriting;
  StartWrite(&summary_);
}

void OpenStepReactor::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  if (phase_ == Phase::kFinished) return;
  if (!ok) {
    EndLocked(absl::UnavailableError("the controller's stream went away"));
  } else if (phase_ == Phase::kSummaryWriting) {
    EndLocked(absl::OkStatus());
  } else {
    WriteSummaryLocked();
  }
}

void OpenStepReactor::EndLocked(const absl::Status& status) {
  if (phase_ == Phase::kFinished) return;
  phase_ = Phase::kFinished;
  calls_->End("OpenStep", start_, status, admitted_, 0, 0, tenant_.name);
  HandOff(this);
  Finish(ToGrpcStatus(status));
}

void OpenStepReactor::OnCancel() {
  std::shared_ptr<StreamingStep> step;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kFinished) return;
    step = step_;
    if (step == nullptr) {
      EndLocked(absl::CancelledError("the controller cancelled its stream"));
      return;
    }
  }
  step->Fail(absl::CancelledError(
      absl::StrCat("step ", step->id(), "'s controller cancelled its stream")));
}

void OpenStepReactor::OnDone() {
  TakeOver(this);
  if (listener_ != nullptr) listener_->Detach();
  std::shared_ptr<StreamingStep> step;
  {
    absl::MutexLock lock(&mu_);
    step = std::move(step_);
  }
  if (step != nullptr) {
    // Its end releases what it held, for every party still attached.
    step->Fail(absl::CancelledError(
        absl::StrCat("step ", step->id(), "'s controller stream ended")));
    steps_->Remove(*step);
  }
  if (admitted_) calls_->Release();
  delete this;
}

ReceiveStepReactor::ReceiveStepReactor(RpcRunner* calls, StepRegistry* steps,
                                       grpc::CallbackServerContext* context,
                                       const v1::ReceiveStepRequest* request)
    : calls_(calls) {
  absl::StatusOr<Tenant> admitted = calls_->Admit(*context, Draining::kRefused);
  absl::Status status = admitted.status();
  if (admitted.ok()) {
    admitted_ = true;
    tenant_ = admitted->name;
    absl::StatusOr<std::shared_ptr<StreamingStep>> step =
        steps->Find(*admitted, request->step_id(), StepAccess::kOwner);
    status = step.status();
    if (step.ok()) {
      step_ = *std::move(step);
      listener_ = std::make_shared<StepListener>([this] { Pump(); });
      // Once attached, a wave committed on another thread wakes the listener:
      // mu_ is held until slot_ is set, so that its Pump waits for the slot.
      absl::MutexLock lock(&mu_);
      absl::StatusOr<int> slot =
          step_->Attach(request->rank(), request->cp_rank(), listener_);
      status = slot.status();
      if (slot.ok()) slot_ = *slot;
    }
  }
  if (!status.ok()) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    EndUnlocked(status, false);
    return;
  }
  Pump();
}

void ReceiveStepReactor::Pump() {
  std::optional<absl::Status> end;
  StreamingStep::Message message;
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_) return;
    message = step_->Next(slot_, &end);
    if (message != nullptr) {
      current_ = message;
      writing_ = true;
      sent_bytes_ += message->response.ByteSizeLong();
    } else if (!end.has_value()) {
      return;
    } else {
      finished_ = true;
    }
  }
  if (message != nullptr) {
    StartWrite(&message->response);
    return;
  }
  EndUnlocked(*end, end->ok());
}

void ReceiveStepReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    current_.reset();
    if (finished_) return;
    if (!ok) finished_ = true;
  }
  if (!ok) {
    EndUnlocked(absl::UnavailableError("the receiver's stream went away"),
                false);
    return;
  }
  Pump();
}

void ReceiveStepReactor::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
  }
  EndUnlocked(absl::CancelledError("the receiver cancelled its stream"), false);
}

void ReceiveStepReactor::EndUnlocked(const absl::Status& status,
                                     bool after_last) {
  int slot = -1;
  size_t sent = 0;
  {
    absl::MutexLock lock(&mu_);
    slot = slot_;
    sent = sent_bytes_;
  }
  if (step_ != nullptr && slot >= 0) step_->Detach(slot, after_last);
  calls_->End("ReceiveStep", start_, status, admitted_, 0, sent, tenant_);
  HandOff(this);
  Finish(ToGrpcStatus(status));
}

void ReceiveStepReactor::OnDone() {
  TakeOver(this);
  if (listener_ != nullptr) listener_->Detach();
  if (admitted_) calls_->Release();
  delete this;
}

}  // namespace packd
