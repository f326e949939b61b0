// MemoryBudget: bounds the request and result bytes of inline calls in flight
// (--max_inflight_bytes, docs/design.md §6). A call reserves its bytes
// before its payload is copied anywhere. One that does not fit waits, without
// holding one of gRPC's threads, until enough is released or its deadline
// passes; one larger than the whole budget is refused at once.
//
// clang-format off
//   budget.Reserve(bytes, deadline, [](absl::StatusOr<MemoryBudget::Hold> hold) {
//     ...  // the hold returns its bytes when the last copy is destroyed
//     MemoryBudget::ShrinkTo(*hold, needed);  // or some of them earlier
//   });
// clang-format on
#ifndef PACKD_SERVICE_MEMORY_BUDGET_H_
#define PACKD_SERVICE_MEMORY_BUDGET_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace packd {

// Safe to share across threads: every method may be called from several at
// once; `done` callbacks run outside its lock.
class MemoryBudget {
 public:
  class Reservation;
  // Bytes reserved; they return to the budget when the last copy goes. Null
  // when the budget has no limit.
  using Hold = std::shared_ptr<Reservation>;
  using Callback = std::function<void(absl::StatusOr<Hold>)>;

  // `limit` bytes; 0 or less: no limit (every reservation succeeds at once).
  // `tenant_limit` (--max_inflight_bytes_per_tenant): the most one tenant's
  // calls may hold of it; 0 or less: the whole budget. A call its tenant has
  // no room for waits without holding up other tenants' calls behind it.
  explicit MemoryBudget(int64_t limit, int64_t tenant_limit = 0);
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
  // holds its request and found it needs more than it reserved). `tenant`:
  // whose call it is (Tenant::name), whose share it counts against.
  void Reserve(int64_t bytes, absl::Time deadline, Callback done,
               bool first = false, const std::string& tenant = "");

  // `bytes` for `tenant` now, or RESOURCE_EXHAUSTED at once when they do
  // not fit now (the budget, the tenant's share, or reservations waiting
  // ahead), without waiting: for holders that refuse rather than queue.
  absl::StatusOr<Hold> TryReserve(int64_t bytes,
                                  const std::string& tenant = "");

  // Counts `bytes` for `tenant` at once, past the limit if need be, and
  // returns their hold (null when the budget has no limit): for bytes a
  // holder already counted that change form (a streaming step's rows packed
  // into the micro-batch that holds them), never for new ones.
  Hold Charge(int64_t bytes, const std::string& tenant = "");

  // Returns all but `bytes` of `hold` to the budget at once (nothing when it
  // holds no more, or is null). Not safe against a concurrent ShrinkTo of the
  // same hold.
  static void ShrinkTo(const Hold& hold, int64_t bytes);

  // RESOURCE_EXHAUSTED: a call of `bytes` can never fit (in the budget, or in
  // one tenant's share of it).
  absl::Status TooLarge(int64_t bytes) const;

  int64_t limit() const { return limit_; }
  // The most one call may hold: one tenant's share, or the whole budget.
  int64_t share() const { return tenant_limit_ > 0 ? tenant_limit_ : limit_; }
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
    std::string tenant;
  };
  // Counts `bytes` for `tenant` (mu_ held) and makes their hold.
  Hold Take(int64_t bytes, const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(int64_t bytes, const std::string& tenant);
  // Whether `tenant`'s share has room for `bytes` more.
  bool TenantHasRoom(const std::string& tenant, int64_t bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The index of the first waiter that may be let in now, or -1. Waiters are
  // let in in order, but one whose tenant has no room waits without holding
  // up those behind it.
  int64_t NextReady() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Run();

  const int64_t limit_;
  const int64_t tenant_limit_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int64_t> tenant_in_use_ ABSL_GUARDED_BY(mu_);
  std::deque<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started with the first waiter
};

// Bytes of a budget in use, returned when the reservation goes. Made only by
// MemoryBudget (Reserve), for bytes it has counted; not safe to shrink from
// two threads at once.
class MemoryBudget::Reservation {
 public:
  Reservation(MemoryBudget* budget, int64_t bytes, std::string tenant)
      : budget_(budget), bytes_(bytes), tenant_(std::move(tenant)) {}
  ~Reservation() { budget_->Release(bytes_, tenant_); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  int64_t bytes() const { return bytes_; }
  // Returns all but `bytes` to the budget at once (nothing when it holds no
  // more).
  void ShrinkTo(int64_t bytes) {
    if (bytes_ <= bytes) return;
    const int64_t returned = bytes_ - std::max<int64_t>(bytes, 0);
    bytes_ -= returned;
    budget_->Release(returned, tenant_);
  }

 private:
  MemoryBudget* const budget_;
  int64_t bytes_;
  const std::string tenant_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_MEMORY_BUDGET_H_
