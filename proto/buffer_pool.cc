#include "proto/buffer_pool.h"

#include <malloc.h>
#include <sys/mman.h>

#include <cstdlib>
#include <iterator>

namespace packd {
namespace {

// Capacities in steps of an eighth of a power of two, so that a call a little
// larger than the last reuses its buffer and no buffer wastes more than 1/8.
size_t RoundCapacity(size_t bytes) {
  size_t step = 4096;
  while ((step << 4) <= bytes) step <<= 1;
  return (bytes + step - 1) / step * step;
}

char* Map(size_t capacity) {
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
#ifdef MADV_HUGEPAGE
  if (capacity >= (size_t{2} << 20)) madvise(p, capacity, MADV_HUGEPAGE);
#endif
  return static_cast<char*>(p);
}

}  // namespace

BufferPool::~BufferPool() {
  absl::MutexLock lock(&mu_);
  max_cached_bytes_ = 0;
  TrimLocked();
}

BufferPool& BufferPool::Global() {
  static BufferPool* pool = new BufferPool(int64_t{1} << 30);
  return *pool;
}

std::shared_ptr<char> BufferPool::Get(int64_t bytes) {
  if (bytes < kMinPooledBytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes > 0 ? bytes : 1) != 0) return nullptr;
    return std::shared_ptr<char>(static_cast<char*>(p),
                                 [](char* q) { std::free(q); });
  }
  const size_t capacity = RoundCapacity(static_cast<size_t>(bytes));
  char* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.lower_bound(capacity);
    // The smallest free buffer that fits, unless it is over twice the size.
    if (it != free_.end() && it->first <= 2 * capacity) {
      data = it->second;
      cached_bytes_ -= it->first;
      const size_t found = it->first;
      free_.erase(it);
      return std::shared_ptr<char>(
          data, [this, found](char* q) { Return(q, found); });
    }
  }
  data = Map(capacity);
  if (data == nullptr) return nullptr;
  return std::shared_ptr<char>(
      data, [this, capacity](char* q) { Return(q, capacity); });
}

void BufferPool::Return(char* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    if (cached_bytes_ + static_cast<int64_t>(capacity) <= max_cached_bytes_) {
      free_.emplace(capacity, data);
      cached_bytes_ += capacity;
      return;
    }
  }
  munmap(data, capacity);
}

void BufferPool::SetMaxCachedBytes(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  max_cached_bytes_ = bytes;
  TrimLocked();
}

int64_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void BufferPool::TrimLocked() {
  // The largest go first.
  while (cached_bytes_ > max_cached_bytes_ && !free_.empty()) {
    auto it = std::prev(free_.end());
    munmap(it->second, it->first);
    cached_bytes_ -= it->first;
    free_.erase(it);
  }
}

void KeepFreedMemoryMapped() {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace packd
