#include "service/memory_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace packd {
namespace {

using ::testing::HasSubstr;

// The outcome of one Reserve, filled in whenever `done` runs.
struct Outcome {
  absl::Notification done;
  std::optional<absl::StatusOr<MemoryBudget::Hold>> result;
  MemoryBudget::Callback Callback() {
    return [this](absl::StatusOr<MemoryBudget::Hold> r) {
      result = std::move(r);
      done.Notify();
    };
  }
};

TEST(MemoryBudgetTest, FitsAtOnceAndReleasesWithTheHold) {
  MemoryBudget budget(100);
  Outcome a;
  budget.Reserve(60, absl::InfiniteFuture(), a.Callback());
  ASSERT_TRUE(a.done.HasBeenNotified());  // on this thread
  ASSERT_TRUE(a.result->ok());
  EXPECT_EQ(budget.in_use(), 60);
  a.result.reset();
  EXPECT_EQ(budget.in_use(), 0);
}

TEST(MemoryBudgetTest, TryReserveNeverWaitsNorPassesAWaiter) {
  MemoryBudget budget(100, /*tenant_limit=*/70);
  absl::StatusOr<MemoryBudget::Hold> a = budget.TryReserve(60, "a");
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::StatusOr<MemoryBudget::Hold> full = budget.TryReserve(50, "b");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("60 of 100 bytes"));
  const absl::StatusOr<MemoryBudget::Hold> share = budget.TryReserve(20, "a");
  EXPECT_EQ(share.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(share.status().message(), HasSubstr("tenant a's share of 70"));
  EXPECT_EQ(budget.TryReserve(101, "b").status().code(),
            absl::StatusCode::kResourceExhausted);
  // A waiter ahead that the budget's room would let in keeps its turn.
  Outcome waiting;
  budget.Reserve(45, absl::InfiniteFuture(), waiting.Callback(), false, "b");
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  EXPECT_FALSE(budget.TryReserve(30, "c").ok()) << "fits, but b waits first";
  a->reset();
  waiting.done.WaitForNotification();
  EXPECT_TRUE(waiting.result->ok());
  EXPECT_EQ(budget.in_use(), 45);
  EXPECT_TRUE(budget.TryReserve(30, "c").ok());
  EXPECT_TRUE(MemoryBudget(0).TryReserve(1 << 30).value() == nullptr)
      << "no limit: every reservation, and no hold";
}

TEST(MemoryBudgetTest, ChargeCountsPastTheLimitUntilTheHoldGoes) {
  MemoryBudget budget(100);
  absl::StatusOr<MemoryBudget::Hold> rows = budget.TryReserve(90);
  ASSERT_TRUE(rows.ok());
  MemoryBudget::Hold message = budget.Charge(40);
  EXPECT_EQ(budget.in_use(), 130) << "a change of form is never refused";
  rows->reset();  // the rows went into the message
  EXPECT_EQ(budget.in_use(), 40);
  EXPECT_FALSE(budget.TryReserve(61).ok());
  message.reset();
  EXPECT_EQ(budget.in_use(), 0);
  EXPECT_EQ(MemoryBudget(0).Charge(40), nullptr);
}

TEST(MemoryBudgetTest, LargerThanTheBudgetIsRefusedAtOnce) {
  MemoryBudget budget(100);
  Outcome a;
  budget.Reserve(101, absl::InfiniteFuture(), a.Callback());
  ASSERT_TRUE(a.done.HasBeenNotified());
  EXPECT_EQ(a.result->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(a.result->status().message()),
              HasSubstr("--max_inflight_bytes"));
}

TEST(MemoryBudgetTest, ShrinkingAHoldReturnsTheRestAndLetsWaitersIn) {
  MemoryBudget budget(100);
  Outcome a, b;
  budget.Reserve(90, absl::InfiniteFuture(), a.Callback());
  budget.Reserve(50, absl::InfiniteFuture(), b.Callback());
  EXPECT_FALSE(b.done.HasBeenNotified());
  MemoryBudget::ShrinkTo(**a.result, 95);  // no more than it holds: nothing
  EXPECT_EQ((**a.result)->bytes(), 90);
  MemoryBudget::ShrinkTo(**a.result, 30);
  EXPECT_EQ((**a.result)->bytes(), 30);
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(b.result->ok());
  EXPECT_EQ(budget.in_use(), 80);
  a.result.reset();  // returns what it still holds, not what it first took
  b.result.reset();
  EXPECT_EQ(budget.in_use(), 0);
  MemoryBudget::ShrinkTo(nullptr, 0);  // no limit, no hold: nothing to do
}

TEST(MemoryBudgetTest, FirstInLineGoesAheadOfEveryWaiter) {
  MemoryBudget budget(100);
  Outcome holder, waiting, first;
  budget.Reserve(70, absl::InfiniteFuture(), holder.Callback());
  budget.Reserve(40, absl::InfiniteFuture(), waiting.Callback());
  // Fits now: granted at once, although another call waits.
  Outcome small;
  budget.Reserve(20, absl::InfiniteFuture(), small.Callback(), /*first=*/true);
  ASSERT_TRUE(small.done.HasBeenNotified());
  budget.Reserve(60, absl::InfiniteFuture(), first.Callback(), /*first=*/true);
  EXPECT_FALSE(first.done.HasBeenNotified());
  EXPECT_EQ(budget.waiting(), 2);
  holder.result.reset();  // 20 in use: the first-in-line 60 goes, not the 40
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  EXPECT_EQ(budget.waiting(), 1);
  first.result.reset();
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(waiting.result->ok());
  EXPECT_EQ(budget.waiting(), 0);
}

TEST(MemoryBudgetTest, WaitersGetTheirHoldInOrderWhenBytesAreReleased) {
  MemoryBudget budget(100);
  Outcome first, second, third;
  budget.Reserve(80, absl::InfiniteFuture(), first.Callback());
  budget.Reserve(50, absl::InfiniteFuture(), second.Callback());
  // The third fits, but waits its turn behind the second.
  budget.Reserve(10, absl::InfiniteFuture(), third.Callback());
  EXPECT_FALSE(second.done.HasBeenNotified());
  EXPECT_FALSE(third.done.HasBeenNotified());
  first.result.reset();  // releases 80
  ASSERT_TRUE(second.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(third.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(second.result->ok());
  EXPECT_TRUE(third.result->ok());
  EXPECT_EQ(budget.in_use(), 60);
}

TEST(MemoryBudgetTest, AWaiterGivesUpAtItsDeadline) {
  MemoryBudget budget(100);
  Outcome first, second;
  budget.Reserve(100, absl::InfiniteFuture(), first.Callback());
  const absl::Time start = absl::Now();
  budget.Reserve(1, start + absl::Milliseconds(100), second.Callback());
  ASSERT_TRUE(second.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(second.result->status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.result->status().message()),
              HasSubstr("deadline"));
  EXPECT_EQ(budget.in_use(), 100);
}

TEST(MemoryBudgetTest, NoLimitAndDestructionWithWaiters) {
  MemoryBudget unlimited(0);
  Outcome a;
  unlimited.Reserve(int64_t{1} << 60, absl::InfiniteFuture(), a.Callback());
  EXPECT_TRUE(a.result->ok());

  Outcome held, waiting;
  {
    MemoryBudget budget(10);
    budget.Reserve(10, absl::InfiniteFuture(), held.Callback());
    budget.Reserve(5, absl::InfiniteFuture(), waiting.Callback());
    held.result.reset();  // released before the budget goes
    ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    waiting.result.reset();
  }
  EXPECT_GT(MemoryBudget::DefaultLimit(), 0);
}

}  // namespace
// One tenant's share (--max_inflight_bytes_per_tenant): a call its tenant
// has no room for waits without holding up another tenant's calls, and is
// let in, in order, once its tenant's bytes come back; a call larger than a
// share is refused at once, naming the flag.
TEST(MemoryBudgetTest, ATenantOverItsShareWaitsWithoutHoldingUpOthers) {
  MemoryBudget budget(100, 60);
  EXPECT_EQ(budget.share(), 60);
  Outcome a1, a2, b1, b2, too_large;
  budget.Reserve(60, absl::InfiniteFuture(), a1.Callback(), false, "a");
  ASSERT_TRUE(a1.result->ok());
  budget.Reserve(30, absl::InfiniteFuture(), a2.Callback(), false, "a");
  EXPECT_FALSE(a2.done.HasBeenNotified());  // a's share is full
  budget.Reserve(40, absl::InfiniteFuture(), b1.Callback(), false, "b");
  ASSERT_TRUE(b1.done.HasBeenNotified()) << "b waited behind a's call";
  EXPECT_TRUE(b1.result->ok());
  budget.Reserve(10, absl::InfiniteFuture(), b2.Callback(), false, "b");
  EXPECT_FALSE(b2.done.HasBeenNotified());  // the budget is full
  budget.Reserve(61, absl::InfiniteFuture(), too_large.Callback(), false, "b");
  EXPECT_EQ(too_large.result->status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_large.result->status().message()),
              HasSubstr("--max_inflight_bytes_per_tenant"));
  a1.result.reset();  // a's 60 come back: a2, then b2
  ASSERT_TRUE(a2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(b2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(a2.result->ok() && b2.result->ok());
  EXPECT_EQ(budget.in_use(), 80);

  // Waiting for its own share past the deadline says so.
  Outcome a3;
  budget.Reserve(31, absl::Now() + absl::Milliseconds(50), a3.Callback(), false,
                 "a");
  ASSERT_TRUE(a3.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_THAT(std::string(a3.result->status().message()),
              HasSubstr("tenant a's share"));
}

// A fair share under load (run under ThreadSanitizer in CI): one tenant
// floods the budget from sixteen threads with calls as large as its share,
// each held 100 ms, and every call of another tenant is let in within its
// 300 ms deadline. Strictly in order, it would wait behind the flood's queue
// (fourteen calls, two at a time: 700 ms) and fail.
TEST(MemoryBudgetTest, AFloodingTenantLeavesAnotherServedWithinItsDeadlines) {
  MemoryBudget budget(1000, 500);
  std::atomic<bool> stop{false};
  std::vector<std::thread> flood;
  for (int t = 0; t < 16; ++t) {
    flood.emplace_back([&] {
      while (!stop.load()) {
        Outcome o;
        budget.Reserve(500, absl::Now() + absl::Seconds(10), o.Callback(),
                       false, "flood");
        o.done.WaitForNotification();
        absl::SleepFor(absl::Milliseconds(100));  // the call runs, holding it
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(200));  // the flood's queue builds up
  for (int i = 0; i < 20; ++i) {
    Outcome o;
    budget.Reserve(400, absl::Now() + absl::Milliseconds(300), o.Callback(),
                   false, "other");
    ASSERT_TRUE(o.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o.result->ok()) << i << ": " << o.result->status();
  }
  stop = true;
  for (std::thread& t : flood) t.join();
  EXPECT_EQ(budget.in_use(), 0);
}

}  // namespace packd
