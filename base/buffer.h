// Buffer: owned memory for results the library allocates, and HostBufferPool,
// the warm host memory behind it.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(Buffer b, HostBufferPool::Global().Acquire(n));  // warm pages
//   memcpy(b.data(), src, n);  // b returns to the pool when destroyed
// clang-format on
//
// Why a pool: fresh pages cost more to fault in than packing writes into them
// (about 13 ms of page faults for 38 MiB with 4 KiB pages, against about 3 ms
// to copy 38 MiB). Results of similar sizes recur call after call, so blocks
// are kept and handed out again; new large blocks ask for transparent huge
// pages, which cuts the first-touch cost about eightfold.
#ifndef PACKD_BASE_BUFFER_H_
#define PACKD_BASE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/tensor_view.h"

namespace packd {

// Move-only owner of a block of memory on one device. Destroying it runs its
// release function.
class Buffer {
 public:
  using Release = std::function<void(void* data, size_t capacity)>;

  Buffer() = default;
  Buffer(void* data, size_t size, size_t capacity, Device device,
         Release release)
      : data_(data),
        size_(size),
        capacity_(capacity),
        device_(device),
        release_(std::move(release)) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const Device& device() const { return device_; }
  // Releases the memory now; the buffer becomes empty.
  void Reset();

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  Device device_;
  Release release_;
};

// A thread-safe cache of memory blocks of one kind (host, device, pinned host),
// the mechanism behind every packd pool. A request is rounded up by `round`;
// a cached block of at least that size, and at most twice it, is handed out
// again; otherwise `allocate` makes a new one. Destroying the Buffer returns
// its block, kept while the cache holds at most `max_cached_bytes`, else given
// to `free`.
class BlockPool {
 public:
  using RoundFn = std::function<size_t(size_t bytes)>;
  using AllocateFn = std::function<absl::StatusOr<void*>(size_t capacity)>;
  using FreeFn = std::function<void(void* data, size_t capacity)>;

  BlockPool(Device device, size_t max_cached_bytes, RoundFn round,
            AllocateFn allocate, FreeFn free)
      : device_(device),
        max_cached_bytes_(max_cached_bytes),
        round_(std::move(round)),
        allocate_(std::move(allocate)),
        free_fn_(std::move(free)) {}
  ~BlockPool() { Trim(); }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A buffer of at least `bytes` bytes, contents unspecified; the error of
  // `allocate` when a new block is needed and cannot be had.
  absl::StatusOr<Buffer> Acquire(size_t bytes);

  // Bytes currently cached (not handed out).
  size_t cached_bytes() const;
  // Frees every cached block.
  void Trim();

 private:
  void Return(void* data, size_t capacity);

  const Device device_;
  const size_t max_cached_bytes_;
  const RoundFn round_;
  const AllocateFn allocate_;
  const FreeFn free_fn_;
  mutable absl::Mutex mu_;
  std::multimap<size_t, void*> free_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// The host pool: blocks of at least kLargeBlock bytes come from mmap with
// MADV_HUGEPAGE and are rounded up to 2 MiB; smaller ones come from
// aligned_alloc, 64-byte aligned.
class HostBufferPool {
 public:
  static constexpr size_t kAlignment = 64;
  static constexpr size_t kLargeBlock = size_t{1} << 20;

  explicit HostBufferPool(size_t max_cached_bytes);

  // The process-wide pool (never destroyed, so buffers may outlive static
  // destruction). Caches at most 2 GiB unless PACKD_HOST_POOL_BYTES in the
  // environment says otherwise.
  static HostBufferPool& Global();

  // Returns a buffer of at least `bytes` bytes, 64-byte aligned, contents
  // unspecified. A zero-byte request returns a buffer with a valid, non-null
  // pointer. RESOURCE_EXHAUSTED when the system cannot give the memory.
  absl::StatusOr<Buffer> Acquire(size_t bytes) {
    return blocks_.Acquire(bytes);
  }

  size_t cached_bytes() const { return blocks_.cached_bytes(); }
  void Trim() { blocks_.Trim(); }

 private:
  BlockPool blocks_;
};

// Tunes the process's allocator (glibc malloc) to keep freed memory mapped:
// large blocks come from the heap instead of fresh mappings, and up to 1 GiB
// of freed heap stays with the process. gRPC receives and sends each large
// message through buffers it frees when the call ends; returned to the kernel
// at once, they cost the next call a page fault per 4 KiB page (a 128 MiB
// message: 32,768 faults, more than the copy itself). The server calls it
// (--keep_freed_memory), and so do the clients unless told not to.
void KeepFreedMemoryMapped();

}  // namespace packd

#endif  // PACKD_BASE_BUFFER_H_
