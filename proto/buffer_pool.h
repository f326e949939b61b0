// BufferPool: host memory for inline tensors that stays mapped between calls.
// Fresh memory costs a page fault per 4 KiB page on first touch (about 13 ms
// for 38 MiB, more than copying it); buffers handed back are kept, up to a
// cap, and handed out again. Large buffers are mapped with transparent huge
// pages where the kernel allows them.
//
//   std::shared_ptr<char> buffer = BufferPool::Global().Get(bytes);
//   // ... the memory returns to the pool when the last reference goes.
#ifndef PACKD_PROTO_BUFFER_POOL_H_
#define PACKD_PROTO_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace packd {

class BufferPool {
 public:
  // Buffers below this size come from malloc and are not pooled.
  static constexpr int64_t kMinPooledBytes = int64_t{1} << 16;

  // Keeps at most `max_cached_bytes` of returned buffers.
  explicit BufferPool(int64_t max_cached_bytes)
      : max_cached_bytes_(max_cached_bytes) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // The process's pool (1 GiB of cache unless set with SetMaxCachedBytes);
  // never destroyed.
  static BufferPool& Global();

  // A buffer of at least `bytes` (> 0), 64-byte aligned, contents undefined;
  // nullptr when memory is exhausted. The pool must outlive it.
  std::shared_ptr<char> Get(int64_t bytes);

  // Changes the cap; buffers over it are released at once.
  void SetMaxCachedBytes(int64_t bytes);
  int64_t cached_bytes() const;

 private:
  void Return(char* data, size_t capacity);
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  int64_t max_cached_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Free buffers by capacity.
  std::multimap<size_t, char*> free_ ABSL_GUARDED_BY(mu_);
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

#endif  // PACKD_PROTO_BUFFER_POOL_H_
