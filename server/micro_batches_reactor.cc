#include "server/micro_batches_reactor.h"

#include <optional>
#include <utility>

#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "base/tsan.h"
#include "kernels/pack_sizes.h"
#include "proto/grpc_wire.h"
#include "service/pack_reply.h"

namespace packd {

MicroBatchesReactor::MicroBatchesReactor(
    const ReactorEnvironment* env, grpc::GenericCallbackServerContext* context)
    : BudgetedReactor(env, context, "PackMicroBatches") {
  Start();
}

void MicroBatchesReactor::OnWriteDone(bool ok) {
  TakeOver(this);
  env_.metrics->RecordStepPhase("send", absl::Now() - write_started_);
  std::optional<absl::Status> finish;
  bool write = false, prepare = false;
  std::unique_ptr<Message> written;  // let go of once unlocked
  {
    absl::MutexLock lock(&mu_);
    written = std::move(current_);
    writing_ = false;
    if (!ok && failure_.ok()) {
      failure_ = absl::CancelledError(
          "the PackMicroBatches stream ended before every micro-batch was "
          "sent");
    }
    if (!failure_.ok() || (pending_ == nullptr && next_ == messages_)) {
      // Failed, or every message is written: done once no packing runs.
      if (!preparing_) finish = failure_;
    } else if (pending_ != nullptr) {
      current_ = std::move(pending_);
      writing_ = write = true;
      prepare = preparing_ = next_ < messages_;
    }
  }
  if (finish.has_value()) return Done(*finish);
  if (write) Write();
  if (prepare) env_.calls->Submit([this] { PrepareNext(); });
}

absl::StatusOr<int64_t> MicroBatchesReactor::Prepare() {
  PACKD_ASSIGN_OR_RETURN(
      step_, TrainingStep::Make(parsed_, *env_.decoder, env_.max_message_bytes,
                                tenant_));
  messages_ = step_->messages();
  env_.metrics->RecordStepPhase("measure", step_->phases().measure);
  env_.metrics->RecordStepPhase("plan", step_->phases().plan);
  return step_->held_bytes();
}

void MicroBatchesReactor::Serve() {
  if (env_.TEST_call_hook) env_.TEST_call_hook(method_);
  {
    absl::MutexLock lock(&mu_);
    preparing_ = true;
  }
  PrepareNext();
}

void MicroBatchesReactor::FinishOk() {
  HandOff(this);  // OnDone runs on one of gRPC's threads
  Finish(grpc::Status::OK);
}

void MicroBatchesReactor::PrepareNext() {
  while (true) {
    size_t k = 0;
    {
      absl::MutexLock lock(&mu_);
      k = next_++;
    }
    auto message = std::make_unique<Message>();
    absl::Status made =
        Guarded(method_, [&] { return Make(k, message.get()); });
    std::optional<absl::Status> finish;
    bool write = false, more = false;
    {
      absl::MutexLock lock(&mu_);
      if (!made.ok() && failure_.ok()) failure_ = made;
      if (!failure_.ok()) {
        preparing_ = false;
        if (!writing_) finish = failure_;
      } else if (writing_) {
        pending_ = std::move(message);
        preparing_ = false;
      } else {
        current_ = std::move(message);
        writing_ = write = true;
        more = next_ < messages_;
        preparing_ = more;
      }
    }
    if (finish.has_value()) return Done(*finish);
    if (write) Write();
    if (!more) return;
  }
}

absl::Status MicroBatchesReactor::Make(size_t k, Message* out) {
  auto reply = std::make_shared<CallReply<v1::PackMicroBatchesResponse>>();
  const absl::Time start = absl::Now();
  const absl::Duration device_before = step_->device_time();
  const absl::Status made = env_.metrics->OnDevice(
      step_->device(), step_->Message(k, &reply->response, &reply->buffers));
  // A micro-batch may run a wave of the step's device pass.
  const absl::Duration device = step_->device_time() - device_before;
  env_.metrics->RecordStepPhase("device", device);
  env_.metrics->RecordStepPhase("pack", absl::Now() - start - device);
  PACKD_RETURN_IF_ERROR(made);
  const Spliced spliced = reply->response.Serialize();
  PACKD_RETURN_IF_ERROR(env_.decoder->CheckSize("response", spliced.size()));
  out->buffer = ToByteBuffer(spliced, reply);
  out->bytes = spliced.size();
  if (k > 0) {
    out->held = env_.metrics;
    out->held->HoldMicroBatches(1);
  }
  return absl::OkStatus();
}

void MicroBatchesReactor::Write() {
  // Read before the hand-off: once gRPC has the reactor, OnWriteDone may move
  // current_ on its thread.
  Message* const message = current_.get();
  response_bytes_ += message->bytes;
  write_started_ = absl::Now();
  HandOff(this);  // OnWriteDone runs on one of gRPC's threads
  StartWrite(&message->buffer);
}

}  // namespace packd
