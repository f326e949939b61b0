#include "server/rpc_runner.h"

#include <grpc/grpc_security_constants.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "base/spin_wait.h"

namespace packd {
namespace {

// How long a worker polls for the next call before it sleeps.
constexpr std::chrono::microseconds kPollForWork{100};

}  // namespace

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] { Loop(); });
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    work_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::Submit(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
  const int64_t queued = queued_.fetch_add(1, std::memory_order_acq_rel) + 1;
  // The polling thread, if one is, takes one call without a wake-up; a
  // thread that stops polling looks at the queue under mu_ before it sleeps.
  if (queued > (spinning_.load(std::memory_order_acquire) ? 1 : 0)) {
    work_.Signal();
  }
}

void WorkerPool::Loop() {
  // Signals go to the thread that waits for them (packd's SIGTERM and SIGHUP
  // handling), never to a worker, whenever the pool was started.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) {
    // One thread polls for the next call, the others sleep at once: on a
    // machine of few cores, more would take the CPU from gRPC's threads.
    if (!spinning_.exchange(true, std::memory_order_acq_rel)) {
      SpinUntil([this] { return queued_.load(std::memory_order_acquire) > 0; },
                kPollForWork);
      spinning_.store(false, std::memory_order_release);
    }
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) work_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    work();
  }
}

RpcRunner::RpcRunner(Options options, Metrics* metrics)
    : options_(std::move(options)),
      metrics_(metrics),
      pool_(options_.threads) {}

void RpcRunner::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool RpcRunner::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

int64_t RpcRunner::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

absl::StatusOr<Tenant> RpcRunner::TenantOf(
    const grpc::ServerContextBase& context) const {
  if (options_.auth != nullptr) {
    return options_.auth->Check(context.client_metadata());
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> subject =
        auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
    if (!subject.empty()) {
      const std::string name(subject[0].data(), subject[0].size());
      return Tenant::Named(absl::StrCat("cert:", name),
                           Tenant::Digest("cert-", name));
    }
  }
  if (options_.peer_uid) {
    if (std::optional<uid_t> uid = options_.peer_uid(context.peer())) {
      // root's segments keep the bare prefix: it may name any segment.
      Tenant tenant =
          Tenant::Named(absl::StrCat("uid:", *uid),
                        *uid == 0 ? std::string() : absl::StrCat("uid_", *uid));
      tenant.uid = uid;
      return tenant;
    }
  }
  return Tenant();
}

absl::StatusOr<Tenant> RpcRunner::Admit(const grpc::ServerContextBase& context,
                                        Draining draining) {
  absl::StatusOr<Tenant> tenant = TenantOf(context);
  if (!tenant.ok()) return tenant;
  absl::MutexLock lock(&mu_);
  if (draining_ && draining == Draining::kRefused) {
    return absl::UnavailableError(
        "packd is shutting down; retry on another replica");
  }
  ++in_flight_;
  return tenant;
}

void RpcRunner::Release() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

}  // namespace packd
