// MicroBatchesReactor: one PackMicroBatches call (docs/design.md §12), admitted
// by the memory budget before its request is read (BudgetedReactor): the step
// made once its request is parsed (TrainingStep: measured and planned), then
// the plan and one message per micro-batch, written in order. Micro-batch n + 1
// is packed on a worker while n is being sent, and no further: the call holds
// at most two packed micro-batches (the one gRPC is writing and the next), so a
// slow reader holds the server to that, and its reservation covers it.
//
//   return new MicroBatchesReactor(&env, context);   // from CreateReactor
#ifndef PACKD_SERVER_MICRO_BATCHES_REACTOR_H_
#define PACKD_SERVER_MICRO_BATCHES_REACTOR_H_

#include <grpcpp/generic/async_generic_service.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "packd/v1/pack_service.pb.h"
#include "server/budgeted_reactor.h"
#include "service/step.h"

namespace packd {

// Used by gRPC and packd's workers at once (a write in flight while the next
// micro-batch is packed): what both touch is under mu_.
class MicroBatchesReactor final
    : public BudgetedReactor<v1::PackMicroBatchesRequest> {
 public:
  MicroBatchesReactor(const ReactorEnvironment* env,
                      grpc::GenericCallbackServerContext* context);

  void OnWriteDone(bool ok) override;

 private:
  // A message to send; one of a micro-batch counts in the metrics' gauge of
  // micro-batches held until it has been written (or dropped).
  struct Message {
    ~Message() {
      if (held != nullptr) held->HoldMicroBatches(-1);
    }
    grpc::ByteBuffer buffer;
    int64_t bytes = 0;
    Metrics* held = nullptr;
  };

  absl::StatusOr<int64_t> Prepare() override;
  void Serve() override;
  void FinishOk() override;
  // Makes message next_ (0: the plan), then writes it, or leaves it pending
  // while the previous one is written; goes on to the next while nothing is
  // pending. On a worker.
  void PrepareNext();
  // Message k: the plan, or micro-batch k - 1 packed.
  absl::Status Make(size_t k, Message* out);
  // Writes current_.
  void Write();

  std::unique_ptr<TrainingStep> step_;
  size_t messages_ = 0;
  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;       // the next message to make
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // current_ is being written
  bool preparing_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Message> current_;
  // When current_'s write began (set by Write, read by OnWriteDone: one write
  // at a time).
  absl::Time write_started_;
  std::unique_ptr<Message> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_SERVER_MICRO_BATCHES_REACTOR_H_
