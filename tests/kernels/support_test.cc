// The support pieces of the op library: DType, the host buffer pool and the
// thread pool.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/buffer.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/thread_pool.h"

namespace packd {
namespace {

TEST(DType, SizesNamesAndParsing) {
  const int64_t sizes[] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8};
  for (int i = 0; i < 10; ++i) {
    const DType d = kAllDTypes[i];
    EXPECT_EQ(static_cast<int>(d), i + 1);
    EXPECT_EQ(ItemSize(d), sizes[i]) << DTypeName(d);
    DType parsed;
    ASSERT_TRUE(ParseDType(DTypeName(d), &parsed));
    EXPECT_EQ(parsed, d);
  }
  DType parsed;
  EXPECT_TRUE(ParseDType("bf16", &parsed));
  EXPECT_EQ(parsed, DType::kBFloat16);
  EXPECT_FALSE(ParseDType("complex64", &parsed));
  EXPECT_FALSE(IsValidDType(DType::kUnspecified));
  EXPECT_FALSE(IsValidDType(static_cast<DType>(11)));
  EXPECT_EQ(ItemSize(static_cast<DType>(11)), 0);
}

TEST(HostBufferPool, ReusesReturnedBlocksAndRespectsItsLimit) {
  HostBufferPool pool(size_t{8} << 20);
  void* first = nullptr;
  {
    Buffer b = *pool.Acquire(3 << 20);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(b.size(), size_t{3} << 20);
    EXPECT_EQ(
        reinterpret_cast<uintptr_t>(b.data()) % HostBufferPool::kAlignment, 0u);
    std::memset(b.data(), 1, b.size());
    first = b.data();
  }
  EXPECT_EQ(pool.cached_bytes(),
            size_t{4} << 20);  // rounded up to whole 2 MiB pages
  {
    Buffer again = *pool.Acquire(3 << 20);
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(pool.cached_bytes(), 0u);
    Buffer small = *pool.Acquire(100);
    Buffer zero = *pool.Acquire(0);
    EXPECT_NE(zero.data(), nullptr);
    Buffer moved = std::move(small);
    EXPECT_EQ(small.data(), nullptr);
    EXPECT_NE(moved.data(), nullptr);
  }
  {
    // Over the limit: the third block is freed, not cached.
    Buffer a = *pool.Acquire(4 << 20), b = *pool.Acquire(4 << 20),
           c = *pool.Acquire(4 << 20);
  }
  EXPECT_LE(pool.cached_bytes(), size_t{8} << 20);
  pool.Trim();
  EXPECT_EQ(pool.cached_bytes(), 0u);
}

TEST(BlockPool, ReusesWithinTwiceTheSizeAndFreesWhatItDoesNotKeep) {
  int allocated = 0, freed = 0;
  std::vector<std::unique_ptr<char[]>> storage;
  {
    BlockPool pool(
        Device{DeviceKind::kCuda, 3}, /*max_cached_bytes=*/1450,
        [](size_t bytes) { return (bytes + 99) / 100 * 100; },
        [&](size_t capacity) -> absl::StatusOr<void*> {
          if (capacity > 5000) return absl::ResourceExhaustedError("too big");
          ++allocated;
          storage.emplace_back(new char[capacity]);
          return static_cast<void*>(storage.back().get());
        },
        [&](void*, size_t) { ++freed; });
    void* first = nullptr;
    {
      absl::StatusOr<Buffer> b = pool.Acquire(950);
      ASSERT_TRUE(b.ok());
      EXPECT_EQ(b->size(), 950u);
      EXPECT_EQ(b->device(), (Device{DeviceKind::kCuda, 3}));
      first = b->data();
    }
    EXPECT_EQ(pool.cached_bytes(), 1000u);
    {
      absl::StatusOr<Buffer> again =
          pool.Acquire(600);  // 1000 <= 2 * 600: reused
      EXPECT_EQ(again->data(), first);
      absl::StatusOr<Buffer> small = pool.Acquire(400);  // nothing cached fits
      EXPECT_NE(small->data(), first);
      EXPECT_EQ(allocated, 2);
    }
    EXPECT_EQ(pool.cached_bytes(), 1400u);
    {
      // 400 > 2 * 100: the cached block would waste too much; a new one.
      absl::StatusOr<Buffer> tiny = pool.Acquire(100);
    }
    EXPECT_EQ(allocated, 3);
    EXPECT_EQ(freed, 1);  // 1400 + 100 is over the 1450 cap
    EXPECT_EQ(pool.Acquire(6000).status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  EXPECT_EQ(freed, 3);  // the two cached blocks, on destruction
}

TEST(ThreadPool, RunsEveryPieceOnceAlsoUnderConcurrentCallers) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.num_threads(), 4);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 200; ++round) {
        const int n = 1 + round % 9;
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, [&](int i) { hits[i].fetch_add(1); });
        for (auto& h : hits) failures += h.load() != 1;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
  pool.ParallelFor(0, [&](int) { ADD_FAILURE() << "no piece should run"; });
}

// Workers asleep (a pause longer than they spin) and workers still spinning
// (back to back) both take the next job; each piece runs once either way.
TEST(ThreadPool, RunsEveryPieceOnceWhetherWorkersSleepOrSpin) {
  ThreadPool pool(3);
  for (int round = 0; round < 40; ++round) {
    if (round % 2 == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const int n = 2 + round % 7;
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](int i) { hits[i].fetch_add(1); });
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(hits[i].load(), 1) << "round " << round << " piece " << i;
    }
  }
}

}  // namespace
}  // namespace packd
