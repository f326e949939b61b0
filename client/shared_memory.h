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
#include "client/region_arena.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

// Not safe to share across threads: one thread at a time allocates from it.
class SharedMemory : public RegionArena {
 public:
  // Creates and maps a segment named `key` ("/packd_...") (the errors of
  // ShmMapping::Create). The segment is unlinked and unmapped on destruction,
  // after `on_close` (which unregisters it) runs.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(
      std::string key, std::string region, int64_t bytes,
      std::function<void()> on_close);

  // A tensor of `shape` and `dtype` in the segment (64-byte aligned), or an
  // undefined tensor when the segment is full.
  at::Tensor Empty(at::IntArrayRef shape, at::ScalarType dtype);

 private:
  friend class RegionArena;  // CreateAs
  SharedMemory() = default;
};

}  // namespace packd

#endif  // PACKD_CLIENT_SHARED_MEMORY_H_
