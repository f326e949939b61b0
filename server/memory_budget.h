// MemoryBudget: bounds the request and result bytes of inline calls in flight
// (--max_inflight_bytes, docs/design.md §6). A call reserves its bytes
// before its payload is copied anywhere. One that does not fit waits, without
// holding one of gRPC's threads, until enough is released or its deadline
// passes; one larger than the whole budget is refused at once.
//
//   budget.Reserve(bytes, deadline, [](absl::StatusOr<MemoryBudget::Hold> hold)
//   {
//     ...  // the hold returns its bytes when the last copy is destroyed
//     MemoryBudget::ShrinkTo(*hold, needed);  // or some of them earlier
//   });
#ifndef PACKD_SERVER_MEMORY_BUDGET_H_
#define PACKD_SERVER_MEMORY_BUDGET_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace packd {

class MemoryBudget {
 public:
  class Reservation;
  // Bytes reserved; they return to the budget when the last copy goes. Null
  // when the budget has no limit.
  using Hold = std::shared_ptr<Reservation>;
  using Callback = std::function<void(absl::StatusOr<Hold>)>;

  // `limit` bytes; 0 or less: no limit (every reservation succeeds at once).
  explicit MemoryBudget(int64_t limit);
  // Waiting reservations get UNAVAILABLE. Holds must not outlive the budget.
  ~MemoryBudget();
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Calls `done` exactly once: on this thread when `bytes` fit now (or there
  // is no limit), or when `bytes` exceed the whole budget (RESOURCE_EXHAUSTED
  // naming --max_inflight_bytes); otherwise later, from the budget's own
  // thread, with a hold once enough bytes are released, or with
  // RESOURCE_EXHAUSTED at `deadline`. Waiting calls are served in order.
  // `first`: ahead of every waiting reservation (for a call that already
  // holds its request and found it needs more than it reserved).
  void Reserve(int64_t bytes, absl::Time deadline, Callback done,
               bool first = false);

  // Returns all but `bytes` of `hold` to the budget at once (nothing when it
  // holds no more, or is null). Not safe against a concurrent ShrinkTo of the
  // same hold.
  static void ShrinkTo(const Hold& hold, int64_t bytes);

  // RESOURCE_EXHAUSTED: a call of `bytes` can never fit.
  absl::Status TooLarge(int64_t bytes) const;

  int64_t limit() const { return limit_; }
  int64_t in_use() const;
  // Reservations waiting for bytes to be released.
  int64_t waiting() const;

  // The default --max_inflight_bytes: half the memory this process may use,
  // the smaller of physical memory and the cgroup's memory limit (v2 or v1).
  static int64_t DefaultLimit();

 private:
  struct Waiter {
    int64_t bytes;
    absl::Time deadline;
    Callback done;
  };
  Hold MakeHold(int64_t bytes);
  void Release(int64_t bytes);
  void Run();

  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started with the first waiter
};

// Bytes of a budget in use, returned when the reservation goes. Made only by
// MemoryBudget (Reserve), for bytes it has counted; not safe to shrink from
// two threads at once.
class MemoryBudget::Reservation {
 public:
  Reservation(MemoryBudget* budget, int64_t bytes)
      : budget_(budget), bytes_(bytes) {}
  ~Reservation() { budget_->Release(bytes_); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  int64_t bytes() const { return bytes_; }
  // Returns all but `bytes` to the budget at once (nothing when it holds no
  // more).
  void ShrinkTo(int64_t bytes) {
    if (bytes_ <= bytes) return;
    const int64_t returned = bytes_ - std::max<int64_t>(bytes, 0);
    bytes_ -= returned;
    budget_->Release(returned);
  }

 private:
  MemoryBudget* const budget_;
  int64_t bytes_;
};

}  // namespace packd

#endif  // PACKD_SERVER_MEMORY_BUDGET_H_
