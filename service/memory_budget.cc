#include "service/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace packd {
namespace {

// The number in the first line of `path`, or -1 ("max", missing, unreadable).
int64_t ReadLimit(const char* path) {
  std::ifstream f(path);
  std::string line;
  int64_t value = -1;
  if (!std::getline(f, line) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value)) {
    return -1;
  }
  return value;
}

}  // namespace

MemoryBudget::MemoryBudget(int64_t limit, int64_t tenant_limit)
    : limit_(limit),
      tenant_limit_(limit > 0 && tenant_limit > 0 && tenant_limit < limit
                        ? tenant_limit
                        : 0) {}

MemoryBudget::~MemoryBudget() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int64_t MemoryBudget::DefaultLimit() {
  int64_t memory = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) *
                   static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  for (const char* path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const int64_t cgroup = ReadLimit(path);
    if (cgroup > 0) memory = std::min(memory, cgroup);
  }
  return std::max<int64_t>(memory / 2, int64_t{1} << 20);
}

int64_t MemoryBudget::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

int64_t MemoryBudget::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiters_.size());
}

MemoryBudget::Hold MemoryBudget::Take(int64_t bytes,
                                      const std::string& tenant) {
  in_use_ += bytes;
  if (tenant_limit_ > 0) tenant_in_use_[tenant] += bytes;
  return Hold(new Reservation(this, bytes, tenant));
}

absl::StatusOr<MemoryBudget::Hold> MemoryBudget::TryReserve(
    int64_t bytes, const std::string& tenant) {
  if (limit_ <= 0 || bytes <= 0) return Hold();
  if (bytes > limit_ || (tenant_limit_ > 0 && bytes > tenant_limit_)) {
    return TooLarge(bytes);
  }
  absl::MutexLock lock(&mu_);
  bool waiting_ahead = false;
  for (const Waiter& w : waiters_) {
    waiting_ahead = waiting_ahead || TenantHasRoom(w.tenant, w.bytes);
  }
  if (!waiting_ahead && in_use_ + bytes <= limit_ &&
      TenantHasRoom(tenant, bytes)) {
    return Take(bytes, tenant);
  }
  return absl::ResourceExhaustedError(
      TenantHasRoom(tenant, bytes)
          ? absl::StrCat(in_use_, " of ", limit_, " bytes are in use")
          : absl::StrCat("tenant ", tenant, "'s share of ", tenant_limit_,
                         " bytes (--max_inflight_bytes_per_tenant) is in use"));
}

MemoryBudget::Hold MemoryBudget::Charge(int64_t bytes,
                                        const std::string& tenant) {
  if (limit_ <= 0) return nullptr;
  absl::MutexLock lock(&mu_);
  return Take(std::max<int64_t>(bytes, 0), tenant);
}

bool MemoryBudget::TenantHasRoom(const std::string& tenant,
                                 int64_t bytes) const {
  if (tenant_limit_ <= 0) return true;
  auto it = tenant_in_use_.find(tenant);
  return (it == tenant_in_use_.end() ? 0 : it->second) + bytes <= tenant_limit_;
}

int64_t MemoryBudget::NextReady() const {
  for (size_t i = 0; i < waiters_.size(); ++i) {
    const Waiter& w = waiters_[i];
    if (!TenantHasRoom(w.tenant, w.bytes)) continue;  // waits for its own
    if (in_use_ + w.bytes <= limit_) return static_cast<int64_t>(i);
    return -1;  // in order: the first that needs the budget's room waits
  }
  return -1;
}

void MemoryBudget::ShrinkTo(const Hold& hold, int64_t bytes) {
  if (hold != nullptr) hold->ShrinkTo(bytes);
}

void MemoryBudget::Release(int64_t bytes, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  in_use_ -= bytes;
  if (tenant_limit_ > 0) {
    auto it = tenant_in_use_.find(tenant);
    if (it != tenant_in_use_.end() && (it->second -= bytes) <= 0) {
      tenant_in_use_.erase(it);
    }
  }
}

absl::Status MemoryBudget::TooLarge(int64_t bytes) const {
  if (tenant_limit_ > 0 && bytes > tenant_limit_ && bytes <= limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the call needs ", bytes,
        " bytes of inline requests and results, more than one tenant's "
        "share of ",
        tenant_limit_,
        " bytes (--max_inflight_bytes_per_tenant); split the batch or use "
        "tensor handles"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the call needs ", bytes,
      " bytes of inline requests and results, more than the server's whole "
      "budget of ",
      limit_,
      " bytes (--max_inflight_bytes); split the batch or use tensor "
      "handles"));
}

void MemoryBudget::Reserve(int64_t bytes, absl::Time deadline, Callback done,
                           bool first, const std::string& tenant) {
  if (limit_ <= 0 || bytes <= 0) {
    done(Hold());
    return;
  }
  if (bytes > limit_ || (tenant_limit_ > 0 && bytes > tenant_limit_)) {
    done(TooLarge(bytes));
    return;
  }
  Hold hold;
  {
    absl::MutexLock lock(&mu_);
    // In now when it fits and no waiter that the budget's room would let in
    // is ahead of it (those waiting for their tenant's room do not count).
    bool waiting_ahead = false;
    for (const Waiter& w : waiters_) {
      waiting_ahead = waiting_ahead || TenantHasRoom(w.tenant, w.bytes);
    }
    if ((first || !waiting_ahead) && in_use_ + bytes <= limit_ &&
        TenantHasRoom(tenant, bytes)) {
      hold = Take(bytes, tenant);
    } else {
      Waiter waiter{bytes, deadline, std::move(done), tenant};
      if (first) {
        waiters_.push_front(std::move(waiter));
      } else {
        waiters_.push_back(std::move(waiter));
      }
      if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
      return;
    }
  }
  done(std::move(hold));
}

void MemoryBudget::Run() {
  while (true) {
    std::vector<std::pair<Callback, absl::StatusOr<Hold>>> ready;
    {
      absl::MutexLock lock(&mu_);
      // Wake when a release lets the first waiter in (a release unlocks mu_,
      // which re-evaluates the condition), when a waiter arrives, or at the
      // earliest deadline.
      const size_t seen = waiters_.size();
      absl::Time wake = absl::InfiniteFuture();
      for (const Waiter& w : waiters_) wake = std::min(wake, w.deadline);
      auto wake_up = [this, seen]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || waiters_.size() != seen || NextReady() >= 0;
      };
      mu_.AwaitWithDeadline(absl::Condition(&wake_up), wake);
      const absl::Time now = absl::Now();
      while (stop_ && !waiters_.empty()) {
        ready.emplace_back(std::move(waiters_.front().done),
                           absl::UnavailableError("packd is shutting down"));
        waiters_.pop_front();
      }
      for (int64_t i = NextReady(); i >= 0; i = NextReady()) {
        Waiter w = std::move(waiters_[i]);
        waiters_.erase(waiters_.begin() + i);
        ready.emplace_back(std::move(w.done), Take(w.bytes, w.tenant));
      }
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (it->deadline <= now) {
          const bool own = !TenantHasRoom(it->tenant, it->bytes);
          ready.emplace_back(
              std::move(it->done),
              absl::ResourceExhaustedError(
                  own ? absl::StrCat("waited until the deadline for ",
                                     it->bytes, " bytes of tenant ", it->tenant,
                                     "'s share of the inline "
                                     "budget (",
                                     tenant_limit_,
                                     " bytes, --max_inflight_bytes_per_tenant, "
                                     "all in use by its calls); retry later, "
                                     "or use tensor handles")
                      : absl::StrCat(
                            "waited until the deadline for ", it->bytes,
                            " bytes of the server's inline budget (", limit_,
                            " bytes, --max_inflight_bytes, ", in_use_,
                            " in use); retry later, or use tensor handles")));
          it = waiters_.erase(it);
        } else {
          ++it;
        }
      }
      if (stop_ && waiters_.empty() && ready.empty()) return;
    }
    for (auto& [done, hold] : ready) done(std::move(hold));
  }
}

}  // namespace packd
