#include "proto/buffer_pool.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

namespace packd {
namespace {

TEST(BufferPoolTest, ReturnedBuffersAreReused) {
  BufferPool pool(int64_t{64} << 20);
  char* first = nullptr;
  {
    std::shared_ptr<char> a = pool.Get(int64_t{3} << 20);
    ASSERT_NE(a, nullptr);
    std::memset(a.get(), 1, int64_t{3} << 20);
    first = a.get();
  }
  EXPECT_GE(pool.cached_bytes(), int64_t{3} << 20);
  std::shared_ptr<char> b = pool.Get((int64_t{3} << 20) - 100);  // a bit less
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(pool.cached_bytes(), 0);
  std::shared_ptr<char> c = pool.Get(int64_t{3} << 20);  // in use: fresh
  EXPECT_NE(c.get(), first);
}

TEST(BufferPoolTest, TheCapIsKept) {
  BufferPool pool(int64_t{4} << 20);
  {
    std::shared_ptr<char> a = pool.Get(int64_t{3} << 20);
    std::shared_ptr<char> b = pool.Get(int64_t{3} << 20);
  }
  EXPECT_LE(pool.cached_bytes(), int64_t{4} << 20);
  pool.SetMaxCachedBytes(0);
  EXPECT_EQ(pool.cached_bytes(), 0);
}

TEST(BufferPoolTest, SmallBuffersAreAlignedAndNotPooled) {
  BufferPool pool(int64_t{4} << 20);
  for (int64_t n :
       {int64_t{1}, int64_t{100}, BufferPool::kMinPooledBytes - 1}) {
    std::shared_ptr<char> a = pool.Get(n);
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % 64, 0u);
  }
  EXPECT_EQ(pool.cached_bytes(), 0);
}

}  // namespace
}  // namespace packd
