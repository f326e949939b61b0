// RpcRunner: the one way every packd RPC runs (docs/design.md §2):
// authentication, admission under the drain, the guard that turns whatever a
// handler throws into INTERNAL, the device check after a failure, metrics,
// and packd's own worker pool, on which every handler runs (never on one of
// gRPC's callback threads, nor on the memory budget's). Handlers only
// translate between protobuf and the op library.
//
// clang-format off
//   grpc::ServerUnaryReactor* Service::ListRegions(ctx, request, response) {
//     return calls_.Unary(ctx, "ListRegions", Draining::kServed, *request, response,
//                         [=](const Tenant& t) { return List(t, response); });
//   }
// clang-format on
#ifndef PACKD_SERVER_RPC_RUNNER_H_
#define PACKD_SERVER_RPC_RUNNER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/tsan.h"
#include "proto/tensor_codec.h"
#include "proto/wire.h"
#include "server/auth.h"
#include "service/metrics.h"
#include "service/tenant.h"

namespace packd {

// A fixed set of threads running submitted work in order of submission.
// Safe to share across threads. Destruction runs what was submitted, then
// joins the threads. After its work one thread at a time polls for the next
// a short while before it sleeps: a call that arrives then starts without a
// wake-up, which costs tens of microseconds on a virtual machine.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> work);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar work_;  // queue_ has more than the polling thread takes
  std::atomic<int64_t> queued_{0};     // queue_.size(), read without mu_
  std::atomic<bool> spinning_{false};  // a thread is polling queued_
  std::vector<std::thread> threads_;
};

// Runs `fn`, turning whatever it throws into INTERNAL naming `method`: nothing
// a handler throws (an allocation that failed, a library's exception) may
// reach gRPC, which would answer UNIMPLEMENTED, or leave a call admitted.
template <typename Fn>
absl::Status Guarded(const char* method, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(method, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(method, " failed"));
  }
}

// Whether a method is refused while the server drains (the calls that do
// work), or still served (small bookkeeping: regions, info), as every call
// is counted in flight until its reply has left.
enum class Draining { kRefused, kServed };

// Safe to share across threads.
class RpcRunner {
 public:
  struct Options {
    // Bearer tokens every call must carry; null: none.
    std::shared_ptr<TokenAuth> auth;
    // The uid of each unix-socket connection packd accepted itself, by the
    // peer gRPC reports for it ("fd:N"); null: none (docs/design.md §15).
    std::function<std::optional<uid_t>(const std::string& peer)> peer_uid;
    // Worker threads (--threads); at least 1.
    int threads = 1;
    // Called after a failed admitted call, before its reply leaves (the
    // service checks whether its default device is lost).
    std::function<void()> after_failure;
  };
  RpcRunner(Options options, Metrics* metrics);

  // From now on, calls of Draining::kRefused methods get UNAVAILABLE; calls
  // already admitted finish.
  void StartDraining();
  // Waits until no admitted call is in flight or `deadline` passes; true when
  // none is.
  bool WaitForIdle(absl::Time deadline);
  int64_t in_flight() const;

  // Admits a call and says whose it is (its tenant: its token's name, its
  // client certificate's subject, its unix-socket peer's uid, else
  // anonymous): UNAUTHENTICATED without a valid token, UNAVAILABLE for a
  // refused method while draining. An admitted call is in flight until
  // Release(), which comes once its reply has been sent.
  absl::StatusOr<Tenant> Admit(const grpc::ServerContextBase& context,
                               Draining draining);
  void Release();
  // Runs `work` on the worker pool.
  void Submit(std::function<void()> work) { pool_.Submit(std::move(work)); }
  // How every call ends, before its reply leaves: an admitted call that
  // failed runs the failure hook (Options::after_failure), and the call is
  // counted in the metrics.
  void End(const char* method, absl::Time start, const absl::Status& status,
           bool admitted, size_t request_bytes, size_t response_bytes,
           const std::string& tenant) {
    if (admitted && !status.ok() && options_.after_failure) {
      options_.after_failure();
    }
    metrics_->Record(method, status.code(), absl::Now() - start, request_bytes,
                     response_bytes, admitted ? tenant : "unadmitted");
  }

  // A unary RPC: admits it, runs `handler` (absl::Status(const Tenant&),
  // filling `response`) on the worker pool under the guard, and finishes it;
  // released once the reply has been sent. A failed call answers an empty
  // response.
  template <typename Request, typename Response, typename Handler>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context,
                                  const char* method, Draining draining,
                                  const Request& request, Response* response,
                                  Handler handler);

 private:
  class UnaryReactor;

  // The tenant of a call (Admit's order), authenticated.
  absl::StatusOr<Tenant> TenantOf(const grpc::ServerContextBase& context) const;

  const Options options_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  WorkerPool pool_;  // last: its threads end before the rest goes
};

class RpcRunner::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // `tenant`: the admitted call's (Tenant::name).
  UnaryReactor(RpcRunner* calls, bool admitted, std::string tenant)
      : calls_(calls), admitted_(admitted), tenant_(std::move(tenant)) {}
  void OnDone() override {
    TakeOver(this);
    if (admitted_) calls_->Release();
    delete this;
  }
  // Ends the call (RpcRunner::End) and finishes it; nothing may touch it
  // afterwards.
  void Done(const char* method, absl::Time start, const absl::Status& status,
            size_t request_bytes, size_t response_bytes) {
    calls_->End(method, start, status, admitted_, request_bytes, response_bytes,
                tenant_);
    HandOff(this);  // OnDone runs on one of gRPC's threads
    Finish(ToGrpcStatus(status));
  }

 private:
  RpcRunner* const calls_;
  const bool admitted_;
  const std::string tenant_;
};

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* RpcRunner::Unary(
    grpc::CallbackServerContext* context, const char* method, Draining draining,
    const Request& request, Response* response, Handler handler) {
  const absl::Time start = absl::Now();
  absl::StatusOr<Tenant> admitted = Admit(*context, draining);
  auto* reactor = new UnaryReactor(this, admitted.ok(),
                                   admitted.ok() ? admitted->name : "");
  if (!admitted.ok()) {
    reactor->Done(method, start, admitted.status(), 0, 0);
    return reactor;
  }
  Submit([this, reactor, method, start, &request, response,
          tenant = *std::move(admitted),
          handler = std::move(handler)]() mutable {
    const absl::Status status =
        Guarded(method, [&] { return handler(tenant); });
    if (!status.ok()) response->Clear();
    reactor->Done(method, start, status, request.ByteSizeLong(),
                  status.ok() ? response->ByteSizeLong() : 0);
  });
  return reactor;
}

}  // namespace packd

#endif  // PACKD_SERVER_RPC_RUNNER_H_
