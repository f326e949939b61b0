#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace packd {

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(
    std::string key, std::string region, int64_t bytes,
    std::function<void()> on_close) {
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
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(\"", key, "\"): ", std::strerror(err)));
  }
  std::unique_ptr<SharedMemory> shm(new SharedMemory);
  shm->key_ = std::move(key);
  shm->region_ = std::move(region);
  shm->data_ = static_cast<char*>(data);
  shm->size_ = bytes;
  shm->on_close_ = std::move(on_close);
  return shm;
}

SharedMemory::~SharedMemory() {
  if (on_close_) on_close_();
  munmap(data_, size_);
  shm_unlink(key_.c_str());
}

char* SharedMemory::Allocate(int64_t bytes) {
  const int64_t start = (used_ + 63) / 64 * 64;
  if (bytes < 0 || start + bytes > size_) return nullptr;
  used_ = start + bytes;
  return data_ + start;
}

at::Tensor SharedMemory::Empty(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  char* p = Allocate(n * static_cast<int64_t>(c10::elementSize(dtype)));
  if (p == nullptr) return at::Tensor();
  return at::from_blob(p, shape, at::TensorOptions().dtype(dtype));
}

bool SharedMemory::Contains(const void* p, int64_t bytes,
                            v1::RegionSlice* slice) const {
  const char* c = static_cast<const char*>(p);
  if (c < data_ || bytes < 0 || c + bytes > data_ + size_) return false;
  slice->set_region(region_);
  slice->set_offset(static_cast<uint64_t>(c - data_));
  slice->set_byte_size(static_cast<uint64_t>(bytes));
  return true;
}

}  // namespace packd
