#include "base/buffer.h"

#include <malloc.h>
#include <sys/mman.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace packd {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    device_ = other.device_;
    release_ = std::move(other.release_);
    other.data_ = nullptr;
    other.size_ = other.capacity_ = 0;
    other.release_ = nullptr;
  }
  return *this;
}

void Buffer::Reset() {
  if (release_) release_(data_, capacity_);
  data_ = nullptr;
  size_ = capacity_ = 0;
  release_ = nullptr;
}

absl::StatusOr<Buffer> BlockPool::Acquire(size_t bytes) {
  const size_t capacity = round_(bytes);
  void* data = nullptr;
  size_t got = capacity;
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.lower_bound(capacity);
    if (it != free_.end() && it->first / 2 <= capacity) {
      got = it->first;
      data = it->second;
      cached_bytes_ -= got;
      free_.erase(it);
    }
  }
  if (data == nullptr) {
    absl::StatusOr<void*> fresh = allocate_(capacity);
    if (!fresh.ok()) return fresh.status();
    data = *fresh;
  }
  return Buffer(data, bytes, got, device_,
                [this](void* p, size_t cap) { Return(p, cap); });
}

void BlockPool::Return(void* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    if (cached_bytes_ + capacity <= max_cached_bytes_) {
      free_.emplace(capacity, data);
      cached_bytes_ += capacity;
      return;
    }
  }
  free_fn_(data, capacity);
}

size_t BlockPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void BlockPool::Trim() {
  std::multimap<size_t, void*> blocks;
  {
    absl::MutexLock lock(&mu_);
    blocks.swap(free_);
    cached_bytes_ = 0;
  }
  for (const auto& [capacity, data] : blocks) free_fn_(data, capacity);
}

HostBufferPool::HostBufferPool(size_t max_cached_bytes)
    : blocks_(
          Device::Cpu(), max_cached_bytes,
          [](size_t bytes) {
            return bytes >= kLargeBlock
                       ? RoundUp(bytes, kHugePage)
                       : RoundUp(bytes == 0 ? 1 : bytes, kAlignment);
          },
          [](size_t capacity) -> absl::StatusOr<void*> {
            // Large requests round up to whole huge pages, small ones to at
            // most kLargeBlock; Free tells them apart the same way.
            void* data = nullptr;
            if (capacity >= kHugePage) {
              data = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
              if (data == MAP_FAILED) {
                return absl::ResourceExhaustedError(absl::StrCat(
                    "cannot map ", capacity, " bytes of host memory"));
              }
              madvise(data, capacity, MADV_HUGEPAGE);
            } else {
              data = std::aligned_alloc(kAlignment, capacity);
              if (data == nullptr) {
                return absl::ResourceExhaustedError(absl::StrCat(
                    "cannot allocate ", capacity, " bytes of host memory"));
              }
            }
            return data;
          },
          [](void* data, size_t capacity) {
            if (capacity >= kHugePage) {
              munmap(data, capacity);
            } else {
              std::free(data);
            }
          }) {}

HostBufferPool& HostBufferPool::Global() {
  static HostBufferPool* pool = [] {
    size_t limit = size_t{2} << 30;
    if (const char* env = std::getenv("PACKD_HOST_POOL_BYTES")) {
      uint64_t v = 0;
      if (absl::SimpleAtoi(env, &v)) limit = v;
    }
    return new HostBufferPool(limit);
  }();
  return *pool;
}

void KeepFreedMemoryMapped() {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace packd
