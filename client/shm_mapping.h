// ShmMapping: a POSIX shared-memory object this process creates and maps, and
// unlinks and unmaps when destroyed — the memory behind a system region. The
// C++ client's SharedMemory, the tests and the benchmarks all make their
// segments here.
//
//   PACKD_ASSIGN_OR_RETURN(auto seg, ShmMapping::Create("/packd_w0", 1 << 20));
//   std::memcpy(seg->data(), bytes, n);
//   // then RegisterSystemRegion with seg->key()
#ifndef PACKD_CLIENT_SHM_MAPPING_H_
#define PACKD_CLIENT_SHM_MAPPING_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace packd {

// Not shared across threads while it is created or moved; its bytes are the
// caller's to share.
class ShmMapping {
 public:
  // Creates (exclusively) and maps `bytes` of the object `key` ("/name").
  // INVALID_ARGUMENT for a non-positive size; INTERNAL when the object cannot
  // be created (it exists, or the name is bad); RESOURCE_EXHAUSTED when it
  // cannot be sized or mapped.
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Create(std::string key,
                                                            int64_t bytes);
  // A fresh key "<prefix>_<pid>_<tag>_<n>": unique within this process, and
  // (a random tag) across processes of other pid namespaces sharing /dev/shm.
  static std::string UniqueKey(const std::string& prefix);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  // Removes the object's name; the memory lives on while this mapping (or a
  // server's) does, and goes when the last one ends, however this process
  // ends. Idempotent.
  void Unlink();
  // Names the memory again as `key`: a new object holding a copy of the bytes,
  // mapped over the old one at the same address, so views of it stay valid
  // (a write racing the copy may be lost). The errors of Create; the old
  // mapping stays on failure.
  absl::Status Relink(std::string key);
  bool linked() const { return linked_; }

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  ShmMapping() = default;
  std::string key_;
  char* data_ = nullptr;
  int64_t size_ = 0;
  bool linked_ = true;
};

}  // namespace packd

#endif  // PACKD_CLIENT_SHM_MAPPING_H_
