// RegionArena: a POSIX shared-memory segment that is a packd region for its
// whole life: a bump allocator over it, the region slice of any range in it,
// and a callback (which unregisters it) when it goes. No tensors: packctl
// uses it as it is, the C++ client's SharedMemory adds libtorch views.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto r, RegionArena::Create(key, "bench-in", 64 << 20, unregister));
//   char* p = r->Allocate(bytes);  r->Contains(p, bytes, request.add_outputs());
// clang-format on
#ifndef PACKD_CLIENT_REGION_ARENA_H_
#define PACKD_CLIENT_REGION_ARENA_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/shm_mapping.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

// Not safe to share across threads: one thread at a time allocates from it.
class RegionArena {
 public:
  // Creates and maps a segment named `key` ("/packd_...") (the errors of
  // ShmMapping::Create) to be region `region`. The segment is unlinked and
  // unmapped on destruction, after `on_close` (which unregisters it) runs.
  static absl::StatusOr<std::unique_ptr<RegionArena>> Create(
      std::string key, std::string region, int64_t bytes,
      std::function<void()> on_close);
  virtual ~RegionArena();
  RegionArena(const RegionArena&) = delete;
  RegionArena& operator=(const RegionArena&) = delete;

  // Raw space of `bytes`, 64-byte aligned; null when full.
  char* Allocate(int64_t bytes);
  // Makes all space free again; what was handed out before aliases what comes
  // next.
  void Reset() { used_ = 0; }

  // Whether [p, p + bytes) lies inside the segment; fills `slice` with its
  // region slice.
  bool Contains(const void* p, int64_t bytes, v1::RegionSlice* slice) const;
  char* At(uint64_t offset) const { return data_ + offset; }

  // The segment. Its name is unlinked once the server has mapped it, and
  // named again (ShmMapping::Relink, a copy) when the server must map it anew.
  ShmMapping& segment() { return *segment_; }
  const std::string& key() const { return segment_->key(); }
  const std::string& region() const { return region_; }
  int64_t size() const { return size_; }
  int64_t used() const { return used_; }

 protected:
  RegionArena() = default;
  // Create for T, RegionArena or a subclass (which befriends RegionArena).
  template <typename T>
  static absl::StatusOr<std::unique_ptr<T>> CreateAs(
      std::string key, std::string region, int64_t bytes,
      std::function<void()> on_close) {
    std::unique_ptr<T> shm(new T);
    absl::Status init = shm->Init(std::move(key), std::move(region), bytes,
                                  std::move(on_close));
    if (!init.ok()) return init;
    return shm;
  }

 private:
  absl::Status Init(std::string key, std::string region, int64_t bytes,
                    std::function<void()> on_close);

  std::unique_ptr<ShmMapping> segment_;  // unlinked after on_close_ runs
  std::string region_;
  char* data_ = nullptr;
  int64_t size_ = 0;
  int64_t used_ = 0;
  std::function<void()> on_close_;
};

}  // namespace packd

#endif  // PACKD_CLIENT_REGION_ARENA_H_
