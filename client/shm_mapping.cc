#include "client/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace packd {

namespace {

// Creates (exclusively) the object `key` of `bytes` and maps it.
absl::StatusOr<char*> CreateAndMap(const std::string& key, int64_t bytes) {
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
  return static_cast<char*>(data);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Create(std::string key,
                                                               int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory size must be positive, not ", bytes));
  }
  absl::StatusOr<char*> data = CreateAndMap(key, bytes);
  if (!data.ok()) return data.status();
  std::unique_ptr<ShmMapping> segment(new ShmMapping);
  segment->key_ = std::move(key);
  segment->data_ = *data;
  segment->size_ = bytes;
  return segment;
}

void ShmMapping::Unlink() {
  if (linked_) shm_unlink(key_.c_str());
  linked_ = false;
}

absl::Status ShmMapping::Relink(std::string key) {
  // Copy into the new object mapped elsewhere, then move that mapping over the
  // old one (mremap replaces what is mapped at data_).
  absl::StatusOr<char*> copy = CreateAndMap(key, size_);
  if (!copy.ok()) return copy.status();
  std::memcpy(*copy, data_, static_cast<size_t>(size_));
  void* moved =
      mremap(*copy, static_cast<size_t>(size_), static_cast<size_t>(size_),
             MREMAP_MAYMOVE | MREMAP_FIXED, data_);
  if (moved == MAP_FAILED) {
    const int err = errno;
    munmap(*copy, static_cast<size_t>(size_));
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mremap(\"", key, "\"): ", std::strerror(err)));
  }
  Unlink();
  key_ = std::move(key);
  linked_ = true;
  return absl::OkStatus();
}

std::string ShmMapping::UniqueKey(const std::string& prefix) {
  static std::atomic<int> counter{0};
  static const uint32_t tag = std::random_device()();
  return absl::StrCat(prefix, "_", getpid(), "_", absl::Hex(tag), "_",
                      counter++);
}

ShmMapping::~ShmMapping() {
  munmap(data_, size_);
  Unlink();
}

}  // namespace packd
