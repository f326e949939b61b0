#include "client/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace packd {

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(std::string key,
                                                               int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory size must be positive, not ", bytes));
  }
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("shm_open(\"", key, "\"): ", std::strerror(errno)));
  }
  if (ftruncate(fd, bytes) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "ftruncate(\"", key, "\", ", bytes, "): ", std::strerror(err)));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the object; no descriptor stays open
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(\"", key, "\"): ", std::strerror(err)));
  }
  std::unique_ptr<ShmSegment> segment(new ShmSegment);
  segment->key_ = std::move(key);
  segment->data_ = static_cast<char*>(data);
  segment->size_ = bytes;
  return segment;
}

std::string ShmSegment::UniqueKey(const std::string& prefix) {
  static std::atomic<int> counter{0};
  return absl::StrCat(prefix, "_", getpid(), "_", counter++);
}

ShmSegment::~ShmSegment() {
  munmap(data_, size_);
  shm_unlink(key_.c_str());
}

}  // namespace packd
