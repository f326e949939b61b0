// GpuAllocations: the device regions a client registered for its callers' GPU
// allocations, each entry owned here: the allocation's device, its identity
// (the IPC handle of its memory) and its region. A tensor finds its region by
// its allocation's identity; an address that comes back as another allocation
// (another handle: the first was freed, and its allocator said nothing) frees
// the old entry. Memory freed while the client lives or after it is gone (the
// device memory's Watch) frees its entry too; the client unregisters what
// TakeFreed returns.
//
// clang-format off
//   std::optional<std::string> region = allocations.Find(0, base, handle);
//   if (!region) region = allocations.Add(0, base, handle, Register(...), &added);
//   device_memory->Watch(base, allocations.OnFreed(0, base, *region));
//   for (const std::string& name : allocations.TakeFreed()) Unregister(name);
// clang-format on
#ifndef PACKD_CLIENT_GPU_ALLOCATIONS_H_
#define PACKD_CLIENT_GPU_ALLOCATIONS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace packd {

// Safe to share across threads; what OnFreed returns may outlive it.
class GpuAllocations {
 public:
  GpuAllocations() : state_(std::make_shared<State>()) {}

  // The region of the allocation on `device` whose memory `ipc_handle` names,
  // if one is registered. An entry at the same address with another handle
  // is freed (its memory went back, and this is new memory there).
  std::optional<std::string> Find(int device, uintptr_t base,
                                  const std::string& ipc_handle);
  // Records `region`, just registered for that allocation, and returns it
  // with *added; or, when another call registered it meanwhile, returns that
  // call's region and frees `region`.
  std::string Add(int device, uintptr_t base, const std::string& ipc_handle,
                  const std::string& region, bool* added);
  // What the device memory calls when the allocation at `base` is freed: it
  // frees `region`'s entry (nothing once the client is gone).
  std::function<void()> OnFreed(int device, uintptr_t base,
                                std::string region) const;
  // The regions freed since the last call (with `all`: every region), whose
  // entries are gone now.
  std::vector<std::string> TakeFreed(bool all = false);

 private:
  struct Entry {
    uintptr_t base = 0;
    std::string region;
  };
  struct State {
    absl::Mutex mu;
    // By device and IPC handle.
    absl::flat_hash_map<std::pair<int, std::string>, Entry> entries
        ABSL_GUARDED_BY(mu);
    std::vector<std::string> freed ABSL_GUARDED_BY(mu);
    // Frees `region`'s entry on `device` at `base`, if it is still there
    // (once: a second word of the same memory changes nothing).
    void Free(int device, uintptr_t base, const std::string& region)
        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  };

  const std::shared_ptr<State> state_;
};

}  // namespace packd

#endif  // PACKD_CLIENT_GPU_ALLOCATIONS_H_
