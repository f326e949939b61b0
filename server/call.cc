#include "server/call.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <utility>

namespace packd {

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] { Loop(); });
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::Submit(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
}

void WorkerPool::Loop() {
  // Signals go to the thread that waits for them (packd's SIGTERM and SIGHUP
  // handling), never to a worker, whenever the pool was started.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

CallMechanism::CallMechanism(Options options, Metrics* metrics)
    : options_(std::move(options)),
      metrics_(metrics),
      pool_(options_.threads) {}

void CallMechanism::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool CallMechanism::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

int64_t CallMechanism::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

absl::Status CallMechanism::Admit(const grpc::ServerContextBase& context,
                                  Draining draining) {
  if (options_.auth != nullptr) {
    absl::Status auth = options_.auth->Check(context.client_metadata());
    if (!auth.ok()) return auth;
  }
  absl::MutexLock lock(&mu_);
  if (draining_ && draining == Draining::kRefused) {
    return absl::UnavailableError(
        "packd is shutting down; retry on another replica");
  }
  ++in_flight_;
  return absl::OkStatus();
}

void CallMechanism::Release() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

}  // namespace packd
