#include "server/memory_budget.h"

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

MemoryBudget::MemoryBudget(int64_t limit) : limit_(limit) {}

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

MemoryBudget::Hold MemoryBudget::MakeHold(int64_t bytes) {
  return Hold(new Reservation(this, bytes));
}

void MemoryBudget::ShrinkTo(const Hold& hold, int64_t bytes) {
  if (hold != nullptr) hold->ShrinkTo(bytes);
}

void MemoryBudget::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ -= bytes;
}

absl::Status MemoryBudget::TooLarge(int64_t bytes) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the call needs ", bytes,
      " bytes of inline requests and results, more than the server's whole "
      "budget of ",
      limit_,
      " bytes (--max_inflight_bytes); split the batch or use tensor "
      "handles"));
}

void MemoryBudget::Reserve(int64_t bytes, absl::Time deadline, Callback done,
                           bool first) {
  if (limit_ <= 0 || bytes <= 0) {
    done(Hold());
    return;
  }
  if (bytes > limit_) {
    done(TooLarge(bytes));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if ((first || waiters_.empty()) && in_use_ + bytes <= limit_) {
      in_use_ += bytes;
    } else {
      Waiter waiter{bytes, deadline, std::move(done)};
      if (first) {
        waiters_.push_front(std::move(waiter));
      } else {
        waiters_.push_back(std::move(waiter));
      }
      if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
      return;
    }
  }
  done(MakeHold(bytes));
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
        return stop_ || waiters_.size() != seen ||
               (!waiters_.empty() &&
                in_use_ + waiters_.front().bytes <= limit_);
      };
      mu_.AwaitWithDeadline(absl::Condition(&wake_up), wake);
      const absl::Time now = absl::Now();
      while (!waiters_.empty() &&
             (stop_ || in_use_ + waiters_.front().bytes <= limit_)) {
        Waiter w = std::move(waiters_.front());
        waiters_.pop_front();
        if (stop_) {
          ready.emplace_back(std::move(w.done),
                             absl::UnavailableError("packd is shutting down"));
          continue;
        }
        in_use_ += w.bytes;
        ready.emplace_back(std::move(w.done), MakeHold(w.bytes));
      }
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (it->deadline <= now) {
          ready.emplace_back(
              std::move(it->done),
              absl::ResourceExhaustedError(absl::StrCat(
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
