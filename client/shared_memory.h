// SharedMemory: a POSIX shared-memory segment registered with packd as a
// region, handing out at::Tensor views into it. Tensors allocated here are
// written in place by the caller and travel to the server as handles; results
// written here are read in place.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto shm, client->CreateSharedMemory(256 << 20));
//   at::Tensor hidden = shm->Empty({16, 1024, 4096}, at::kBFloat16);  // fill in place
//   client->Pack({hidden}, mask, {.results_in = shm.get()});
// clang-format on
#ifndef PACKD_CLIENT_SHARED_MEMORY_H_
#define PACKD_CLIENT_SHARED_MEMORY_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "client/shm_segment.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

class SharedMemory {
 public:
  // Creates and maps a segment named `key` ("/packd_...") (the errors of
  // ShmSegment::Create). The segment is unlinked and unmapped on destruction,
  // after `on_close` (which unregisters it) runs.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(
      std::string key, std::string region, int64_t bytes,
      std::function<void()> on_close);
  ~SharedMemory();

  // A tensor of `shape` and `dtype` in the segment (64-byte aligned), or an
  // undefined tensor when the segment is full.
  at::Tensor Empty(at::IntArrayRef shape, at::ScalarType dtype);
  // Raw space of `bytes`; null when full.
  char* Allocate(int64_t bytes);
  // Makes all space free again; tensors handed out before alias what comes
  // next.
  void Reset() { used_ = 0; }

  // Whether [p, p + bytes) lies inside the segment; fills `slice` with its
  // region slice.
  bool Contains(const void* p, int64_t bytes, v1::RegionSlice* slice) const;
  char* At(uint64_t offset) const { return data_ + offset; }

  // The segment. The client unlinks its name once the server has mapped it,
  // and names it again (ShmSegment::Relink, a copy) when the server must map
  // it anew.
  ShmSegment& segment() { return *segment_; }
  const std::string& key() const { return segment_->key(); }
  const std::string& region() const { return region_; }
  int64_t size() const { return size_; }
  int64_t used() const { return used_; }

 private:
  SharedMemory() = default;
  std::unique_ptr<ShmSegment> segment_;  // unlinked after on_close_ runs
  std::string region_;
  char* data_ = nullptr;
  int64_t size_ = 0;
  int64_t used_ = 0;
  std::function<void()> on_close_;
};

}  // namespace packd

#endif  // PACKD_CLIENT_SHARED_MEMORY_H_
