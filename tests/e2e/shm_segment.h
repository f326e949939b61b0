// ShmSegment: a POSIX shared-memory object a test (the client process) creates,
// maps and unlinks, to register with packd as a region.
//
//   ShmSegment seg(1 << 20);  // key "/packd_test_<pid>_<n>"
//   std::memcpy(seg.data(), bytes, n);
#ifndef PACKD_TESTS_E2E_SHM_SEGMENT_H_
#define PACKD_TESTS_E2E_SHM_SEGMENT_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace packd::testing {

class ShmSegment {
 public:
  explicit ShmSegment(size_t size, const std::string& prefix = "/packd_test")
      : size_(size) {
    static std::atomic<int> counter{0};
    key_ = absl::StrCat(prefix, "_", getpid(), "_", counter++);
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) std::abort();
    data_ = static_cast<char*>(
        mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    if (data_ == MAP_FAILED) std::abort();
  }
  ~ShmSegment() {
    munmap(data_, size_);
    shm_unlink(key_.c_str());
  }
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  size_t size_;
  std::string key_;
  char* data_ = nullptr;
};

}  // namespace packd::testing

#endif  // PACKD_TESTS_E2E_SHM_SEGMENT_H_
