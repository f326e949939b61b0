// ThreadPool: a fixed set of workers that run the pieces of one large copy in
// parallel.
//
//   ThreadPool& pool = ThreadPool::Global();
//   pool.ParallelFor(pool.num_threads(), [&](int i) { CopyPart(i); });
#ifndef PACKD_KERNELS_THREAD_POOL_H_
#define PACKD_KERNELS_THREAD_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace packd {

class ThreadPool {
 public:
  // A pool whose ParallelFor uses `num_threads` threads in all: the caller and
  // num_threads - 1 workers. num_threads < 1 means 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool used by the CPU backend. Its size is
  // SetGlobalThreads' last value, by default the number of hardware threads.
  static ThreadPool& Global();
  // Replaces the global pool's size. Call it at start-up, before the pool is in
  // use.
  static void SetGlobalThreads(int num_threads);

  int num_threads() const { return num_threads_; }

  // Runs fn(0) ... fn(n - 1), each exactly once, and returns when all have
  // finished. The calling thread takes part, and pieces go to whichever thread
  // claims them first: a worker slow to wake leaves its pieces to the others
  // rather than delaying the call. If another ParallelFor is running on this
  // pool (concurrent requests), the caller runs every piece itself instead of
  // waiting for the workers.
  void ParallelFor(int n, absl::FunctionRef<void(int)> fn);

 private:
  void WorkerLoop();
  // Claims and runs pieces of generation `generation` until none is left.
  void RunPieces(uint64_t generation);

  const int num_threads_;
  std::vector<std::thread> workers_;
  absl::Mutex busy_;  // held by the caller whose job the workers are running

  // A job is published by a new generation in ticket_ (the high 32 bits; the
  // low 32 bits are the next piece to claim). Workers spin on it a while after
  // each job before they sleep on wake_: waking a sleeping thread costs tens
  // of microseconds on a virtual machine, more than a small copy.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<absl::FunctionRef<void(int)>*> job_{nullptr};
  std::atomic<int> job_size_{0};
  std::atomic<int> done_pieces_{0};
  std::atomic<int> sleepers_{0};  // workers blocked (or about to) on wake_
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  absl::CondVar wake_;  // a new generation, or stop_
  absl::CondVar done_;  // the last piece of the job finished
};

}  // namespace packd

#endif  // PACKD_KERNELS_THREAD_POOL_H_
