// The streaming step's gRPC streams (docs/design.md §18), over StepRegistry
// (service/stream_step.h): the controller's OpenStep (open, then close; the
// step lives while it is open) and each rank's ReceiveStep (its micro-batches
// as waves commit, then the step's last message). SubmitGroup is a unary
// call (PackServiceImpl). Each stream is admitted by the call mechanism for
// its whole life.
//
// clang-format off
//   return new OpenStepReactor(&calls, &steps, context);   // OpenStep
//   return new ReceiveStepReactor(&calls, &steps, context, request);  // ReceiveStep
// clang-format on
#ifndef PACKD_SERVER_STREAM_STEP_REACTORS_H_
#define PACKD_SERVER_STREAM_STEP_REACTORS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "packd/v1/pack_service.pb.h"
#include "server/rpc_runner.h"
#include "service/step_registry.h"

namespace packd {

// Used by gRPC's threads and the step's (its wake-ups): what both touch is
// under mu_.
class OpenStepReactor final
    : public grpc::ServerBidiReactor<v1::StepControl, v1::StepEvent> {
 public:
  OpenStepReactor(RpcRunner* calls, StepRegistry* steps,
                  grpc::CallbackServerContext* context);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Where the controller's stream is; each moves only forward, and any may
  // end in kFinished (the step's failure, or the stream's).
  enum class Phase {
    kAwaitingOpen,    // no step yet: the first message must open one
    kOpen,            // the step takes groups
    kClosing,         // `close` read: waiting for every rank's last message
    kSummaryReady,    // the summary is made, waiting for a write in flight
    kSummaryWriting,  // the summary is being written: then the stream ends
    kFinished,        // Finish called
  };
  // Writes the step's summary, or finishes with its failure, once it is over.
  void Wake();
  // Starts the summary's write once it is ready and nothing else is written.
  void WriteSummaryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes once (the call's metrics and the step's end); mu_ held.
  void EndLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  RpcRunner* const calls_;
  StepRegistry* const steps_;
  const absl::Time start_ = absl::Now();
  bool admitted_ = false;
  Tenant tenant_;
  v1::StepControl control_;
  absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kAwaitingOpen;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write in flight
  std::shared_ptr<StreamingStep> step_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StepListener> listener_;
  v1::StepEvent opened_, summary_;
};

// Used by gRPC's threads and the step's: what both touch is under mu_.
class ReceiveStepReactor final
    : public grpc::ServerWriteReactor<v1::PackMicroBatchesResponse> {
 public:
  ReceiveStepReactor(RpcRunner* calls, StepRegistry* steps,
                     grpc::CallbackServerContext* context,
                     const v1::ReceiveStepRequest* request);
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Writes the slot's next message, or finishes once nothing more will come.
  void Pump();
  // Finishes (the call's metrics, the slot detached); called without mu_,
  // once finished_ is set.
  void EndUnlocked(const absl::Status& status, bool after_last);

  RpcRunner* const calls_;
  const absl::Time start_ = absl::Now();
  bool admitted_ = false;
  std::string tenant_;
  std::shared_ptr<StreamingStep> step_;
  std::shared_ptr<StepListener> listener_;
  absl::Mutex mu_;
  int slot_ ABSL_GUARDED_BY(mu_) = -1;  // set while attaching, under mu_
  StreamingStep::Message current_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  size_t sent_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace packd

#endif  // PACKD_SERVER_STREAM_STEP_REACTORS_H_
