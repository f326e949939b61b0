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
    End(admitted.status());
    return;
  }
  admitted_ = true;
  tenant_ = admitted->name;
  listener_ = std::make_shared<StepListener>([this] { Wake(); });
  StartRead(&control_);
}

void OpenStepReactor::OnReadDone(bool ok) {
  std::shared_ptr<StreamingStep> step;
  bool close_read = false;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    step = step_;
    close_read = close_read_;
  }
  if (!ok) {
    if (step == nullptr) {
      absl::MutexLock lock(&mu_);
      End(absl::InvalidArgumentError(
          "the controller's stream ended before it opened a step"));
    } else if (!close_read) {
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
        steps_->Open(control_.open());
    absl::MutexLock lock(&mu_);
    if (!opened.ok()) {
      End(opened.status());
      return;
    }
    step_ = *opened;
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
      End(absl::InvalidArgumentError("close came before open"));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      close_read_ = true;
    }
    const absl::Status closed = step->Close();
    if (!closed.ok()) {
      absl::MutexLock lock(&mu_);
      End(closed);
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
    End(bad);
  }
}

void OpenStepReactor::Wake() {
  std::shared_ptr<StreamingStep> step;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || step_ == nullptr || summary_ready_) return;
    step = step_;
  }
  v1::StepEvent summary;
  const std::optional<absl::Status> outcome = step->Outcome(&summary);
  if (!outcome.has_value()) return;
  absl::MutexLock lock(&mu_);
  if (finished_ || summary_ready_) return;
  if (!outcome->ok()) {
    End(*outcome);
    return;
  }
  summary.set_address(steps_->address());
  summary_ = summary;
  summary_ready_ = true;
  WriteSummary();
}

void OpenStepReactor::WriteSummary() {
  if (writing_ || summary_started_ || !summary_ready_) return;
  writing_ = true;
  summary_started_ = true;
  StartWrite(&summary_);
}

void OpenStepReactor::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  if (finished_) return;
  if (!ok) {
    End(absl::UnavailableError("the controller's stream went away"));
  } else if (summary_started_) {
    End(absl::OkStatus());
  } else {
    WriteSummary();
  }
}

void OpenStepReactor::End(const absl::Status& status) {
  if (finished_) return;
  finished_ = true;
  calls_->End("OpenStep", start_, status, admitted_, 0, 0, tenant_);
  HandOff(this);
  Finish(ToGrpcStatus(status));
}

void OpenStepReactor::OnCancel() {
  std::shared_ptr<StreamingStep> step;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    step = step_;
    if (step == nullptr) {
      End(absl::CancelledError("the controller cancelled its stream"));
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
    steps_->Remove(step->id());
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
        steps->Find(request->step_id());
    status = step.status();
    if (step.ok()) {
      step_ = *std::move(step);
      listener_ = std::make_shared<StepListener>([this] { Pump(); });
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
    End(status, false);
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
      sent_bytes_ += message->ByteSizeLong();
    } else if (!end.has_value()) {
      return;
    } else {
      finished_ = true;
    }
  }
  if (message != nullptr) {
    StartWrite(message.get());
    return;
  }
  End(*end, end->ok());
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
    End(absl::UnavailableError("the receiver's stream went away"), false);
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
  End(absl::CancelledError("the receiver cancelled its stream"), false);
}

void ReceiveStepReactor::End(const absl::Status& status, bool after_last) {
  if (step_ != nullptr && slot_ >= 0) step_->Detach(slot_, after_last);
  size_t sent = 0;
  {
    absl::MutexLock lock(&mu_);
    sent = sent_bytes_;
  }
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
