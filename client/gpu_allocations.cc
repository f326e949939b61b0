#include "client/gpu_allocations.h"

#include <utility>

namespace packd {

void GpuAllocations::State::Free(int device, uintptr_t base,
                                 const std::string& region) {
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it->first.first == device && it->second.base == base &&
        it->second.region == region) {
      entries.erase(it);
      freed.push_back(region);
      return;
    }
  }
}

std::optional<std::string> GpuAllocations::Find(int device, uintptr_t base,
                                                const std::string& ipc_handle) {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->entries.find({device, ipc_handle});
  if (it != state_->entries.end()) return it->second.region;
  // Another allocation's memory was at this address: it went back.
  for (const auto& [key, entry] : state_->entries) {
    if (key.first == device && entry.base == base) {
      const std::string region = entry.region;
      state_->Free(device, base, region);
      break;
    }
  }
  return std::nullopt;
}

std::string GpuAllocations::Add(int device, uintptr_t base,
                                const std::string& ipc_handle,
                                const std::string& region, bool* added) {
  absl::MutexLock lock(&state_->mu);
  auto [it, inserted] =
      state_->entries.try_emplace({device, ipc_handle}, Entry{base, region});
  *added = inserted;
  if (!inserted) state_->freed.push_back(region);  // registered twice: one goes
  return it->second.region;
}

std::function<void()> GpuAllocations::OnFreed(int device, uintptr_t base,
                                              std::string region) const {
  std::weak_ptr<State> weak = state_;
  return [weak, device, base, region = std::move(region)] {
    if (std::shared_ptr<State> state = weak.lock()) {
      absl::MutexLock lock(&state->mu);
      state->Free(device, base, region);
    }
  };
}

std::vector<std::string> GpuAllocations::TakeFreed(bool all) {
  absl::MutexLock lock(&state_->mu);
  std::vector<std::string> freed;
  freed.swap(state_->freed);
  if (all) {
    for (auto& [key, entry] : state_->entries) {
      freed.push_back(std::move(entry.region));
    }
    state_->entries.clear();
  }
  return freed;
}

}  // namespace packd
