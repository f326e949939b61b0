// BudgetedReactor: a call of a raw method (Pack, Scatter, PackMicroBatches)
// that the memory budget admits before gRPC reads its request
// (docs/design.md §6), and ReactorEnvironment, the parts of the service such a
// call uses and nothing more.
//
// clang-format off
//   class PackScatterReactor final : public BudgetedReactor<v1::PackRequest> { ... };
//   return new PackScatterReactor(env, context, "Pack", work);   // from CreateReactor
// clang-format on
#ifndef PACKD_SERVER_BUDGETED_REACTOR_H_
#define PACKD_SERVER_BUDGETED_REACTOR_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/tsan.h"
#include "proto/grpc_wire.h"
#include "proto/wire.h"
#include "server/rpc_runner.h"
#include "service/memory_budget.h"
#include "service/metrics.h"
#include "service/request_decoder.h"

namespace packd {

// What a call of a raw method uses of the service: the call mechanism
// (admission, workers, the end of every call), the memory budget, the decoder
// (requests and their size against --max_message_bytes), the metrics (device
// work, micro-batches held) and the message limit. Every pointer outlives the
// calls; safe to share across threads (each part is).
struct ReactorEnvironment {
  RpcRunner* calls = nullptr;
  MemoryBudget* budget = nullptr;
  const RequestDecoder* decoder = nullptr;
  Metrics* metrics = nullptr;
  int64_t max_message_bytes = 0;
  // Extra (for testing): ServiceOptions::TEST_call_hook, called with the
  // method once a call's tensors are decoded; empty in packd.
  std::function<void(absl::string_view method)> TEST_call_hook;
};

// A call served by a generic handler, so that gRPC reads the request only
// once the memory budget has admitted the call: until then it stays with its
// sender (HTTP/2 flow control; the server turns off bandwidth-delay probing so
// that a stream's window stays at 64 KiB until its message is asked for). The
// call reserves what its request can make it hold (from the size its client
// declares in kRequestBytesHeader, else the largest), reads and parses the
// request from the received slices with tensor bytes in place, keeps what it
// needs (Prepare: the request, the inputs gathered, results), and then serves
// it (Serve, on packd's workers). A small call (docs/design.md §2: tensors
// inline, on the host, inputs of at most kSmallCallBytes) is parsed and
// served on the gRPC thread that read it, with no hand-off to the workers and
// back. Pack and Scatter answer one message (PackScatterReactor),
// PackMicroBatches a stream (MicroBatchesReactor). Used by gRPC and packd's
// workers in turn, never at once: each step hands the reactor to the next.
template <typename Request>
class BudgetedReactor : public grpc::ServerGenericBidiReactor {
 public:
  // The most bytes a call's inputs (the tensors it packs or scatters) may
  // have for it to run on the gRPC thread that read it: their copy takes
  // microseconds, less than a hand-off to the workers and back.
  static constexpr int64_t kSmallCallBytes = 64 << 10;

  BudgetedReactor(const ReactorEnvironment* env,
                  grpc::GenericCallbackServerContext* context,
                  const char* method);

  void OnReadDone(bool ok) override;
  // The call has ended: its response sent (or its failure told), so a drain
  // that waits for it also waits for its reply to leave.
  void OnDone() override;

 protected:
  // Admits the call and reserves its memory, then reads the request. Called
  // once by the subclass's constructor.
  void Start();

  // After the parse: what the call needs besides its request (its results),
  // having done what it must before it knows (a step plans). On a worker.
  virtual absl::StatusOr<int64_t> Prepare() = 0;
  // Serves the parsed call, with its memory held, and ends it with Done. On a
  // worker.
  virtual void Serve() = 0;
  // Whether a request of `bytes` may be a small call's: then it is parsed on
  // the gRPC thread that read it. Default: never.
  virtual bool MayBeSmall(size_t /*request_bytes*/) const { return false; }
  // Whether the parsed call is small: its tensors all inline and on the host,
  // its inputs at most kSmallCallBytes, its results inline. Default: never (a
  // step plans before it knows its size, which is a worker's job).
  virtual bool Small() const { return false; }
  // Sends the reply of a call that succeeded and finishes (Done's last step):
  // HandOff(this), then the gRPC call, and nothing after it.
  virtual void FinishOk() = 0;

  // Ends the call (RpcRunner::End), with the reply when `status` is OK.
  // Nothing may touch the reactor afterwards (OnDone deletes it).
  void Done(const absl::Status& status);

  // Lets go of the request's bytes once they are no longer needed, rather
  // than when the reply has been sent.
  void ReleaseRequest();

  const ReactorEnvironment& env_;
  const char* const method_;
  // Whose call it is (RpcRunner::Admit).
  Tenant tenant_;
  MemoryBudget::Hold hold_;
  Wire<Request> parsed_;
  size_t response_bytes_ = 0;

 private:
  // Parses the call and serves it, here when it is small and `may_stay` (the
  // gRPC thread that read it), else on the workers.
  void ParseAndServe(bool may_stay);
  // Parses the request, and sets `needed` to what the call holds from now on:
  // the request, the copies of its inline inputs that arrived in several
  // slices (gathered into one buffer; those in one slice are read in place),
  // and what Prepare says (never more than the budget).
  absl::Status Parse(int64_t* needed);

  const absl::Time start_ = absl::Now();
  const absl::Time deadline_;
  grpc::GenericCallbackServerContext* const context_;
  int64_t declared_bytes_ = 0;
  bool admitted_ = false;
  grpc::ByteBuffer request_;
  size_t request_bytes_ = 0;
};

}  // namespace packd

#endif  // PACKD_SERVER_BUDGETED_REACTOR_H_
