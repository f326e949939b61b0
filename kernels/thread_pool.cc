#include "kernels/thread_pool.h"

#include <algorithm>
#include <chrono>

#include "base/spin_wait.h"

namespace packd {
namespace {

int DefaultThreads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::atomic<int> g_requested_threads{0};

// The low half of a ticket whose generation has no pieces to claim.
constexpr uint64_t kNoPieces = 0xffffffffu;

// How long a worker waits for the next job before it sleeps, and the caller
// for the last piece before it sleeps.
constexpr std::chrono::microseconds kWorkerSpin{200};
constexpr std::chrono::microseconds kCallerSpin{50};

}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(std::max(1, num_threads)) {
  for (int i = 1; i < num_threads_; ++i)
    workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    absl::MutexLock lock(&mu_);
    wake_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::Global() {
  // Never destroyed: worker threads must not be joined during static
  // destruction.
  static ThreadPool* pool = [] {
    const int requested = g_requested_threads.load();
    return new ThreadPool(requested > 0 ? requested : DefaultThreads());
  }();
  return *pool;
}

void ThreadPool::SetGlobalThreads(int num_threads) {
  g_requested_threads.store(num_threads);
}

void ThreadPool::RunPieces(uint64_t generation) {
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    // A stale or closed generation, or every piece claimed. A later job's
    // size may be read here, but then the ticket has moved on and the claim
    // below fails.
    if ((t >> 32) != generation || (t & kNoPieces) == kNoPieces ||
        static_cast<int64_t>(t & kNoPieces) >=
            job_size_.load(std::memory_order_relaxed)) {
      return;
    }
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
      continue;
    }
    // The job cannot end while this piece is unfinished, so job_ and
    // job_size_ are this generation's.
    const int n = job_size_.load(std::memory_order_relaxed);
    (*job_.load(std::memory_order_relaxed))(static_cast<int>(t & kNoPieces));
    if (done_pieces_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      absl::MutexLock lock(&mu_);
      done_.SignalAll();
    }
  }
}

void ThreadPool::ParallelFor(int n, absl::FunctionRef<void(int)> fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty() || !busy_.TryLock()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  // First a generation with no pieces, so that no late claim on the last job
  // can succeed while this one's fields are written; then this job's.
  const uint64_t closed = (ticket_.load() >> 32) + 1;
  ticket_.store(closed << 32 | kNoPieces);
  job_.store(&fn, std::memory_order_relaxed);
  job_size_.store(n, std::memory_order_relaxed);
  done_pieces_.store(0, std::memory_order_relaxed);
  const uint64_t generation = closed + 1;
  ticket_.store(generation << 32);  // publishes the job (seq_cst)
  if (sleepers_.load() > 0) {       // seq_cst: see WorkerLoop
    absl::MutexLock lock(&mu_);
    wake_.SignalAll();
  }
  RunPieces(generation);
  auto finished = [&] {
    return done_pieces_.load(std::memory_order_acquire) == n;
  };
  if (!SpinUntil(finished, kCallerSpin)) {
    absl::MutexLock lock(&mu_);
    while (!finished()) done_.Wait(&mu_);
  }
  job_.store(nullptr, std::memory_order_relaxed);
  busy_.Unlock();
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    uint64_t generation = seen;
    auto news = [&] {
      generation = ticket_.load(std::memory_order_acquire) >> 32;
      return generation != seen || stop_.load(std::memory_order_relaxed);
    };
    if (!SpinUntil(news, kWorkerSpin)) {
      absl::MutexLock lock(&mu_);
      // A caller stores the generation, then reads sleepers_; this thread
      // counts itself, then reads the generation (all seq_cst): one of the
      // two sees the other, so no wake-up is lost.
      sleepers_.fetch_add(1);
      while (!news()) wake_.Wait(&mu_);
      sleepers_.fetch_sub(1);
    }
    if (stop_.load()) return;
    seen = generation;
    RunPieces(generation);  // nothing, for a closed one: the next is news
  }
}

}  // namespace packd
