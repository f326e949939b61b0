#include "server/memory_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "absl/synchronization/notification.h"

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
  budget.Reserve(10, absl::InfiniteFuture(), third.Callback());  // fits, but
  // waits its turn behind the second
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
}  // namespace packd
