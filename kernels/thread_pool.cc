#include "kernels/thread_pool.h"

#include <algorithm>

namespace packd {
namespace {

int DefaultThreads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::atomic<int> g_requested_threads{0};

}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(std::max(1, num_threads)) {
  for (int i = 1; i < num_threads_; ++i)
    workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
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

void ThreadPool::RunPieces() {
  for (int i = next_.fetch_add(1); i < job_size_; i = next_.fetch_add(1))
    (*job_)(i);
}

void ThreadPool::ParallelFor(int n, absl::FunctionRef<void(int)> fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty() || !busy_.TryLock()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  job_ = &fn;
  job_size_ = n;
  next_.store(0);
  {
    absl::MutexLock lock(&mu_);
    pending_workers_ = static_cast<int>(workers_.size());
    ++generation_;
    wake_.SignalAll();
  }
  RunPieces();
  {
    absl::MutexLock lock(&mu_);
    while (pending_workers_ > 0) done_.Wait(&mu_);
  }
  job_ = nullptr;
  busy_.Unlock();
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) wake_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
    }
    RunPieces();
    absl::MutexLock lock(&mu_);
    if (--pending_workers_ == 0) done_.SignalAll();
  }
}

}  // namespace packd
