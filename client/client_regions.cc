// The regions of a Client (client.h): device memory and shared-memory
// segments registered with packd, registered again when the server lost them
// (a lease ran out, a restart), and the pool of scratch segments calls copy
// their tensors into.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/client.h"
#include "proto/address.h"

namespace packd {
namespace {

// Segments of this client are keyed "<shm_key_prefix>_client_..." and
// registered as regions "client-...".
constexpr char kSegmentTag[] = "client";

// Shared-memory room a call needs, rounded up so that slightly larger batches
// reuse the segment: a quarter more, plus 1 MiB. (The Python client's rule is
// the same: python/packd/_regions.py, Regions.scratch_for.)
int64_t ScratchBytes(int64_t bytes) { return bytes + bytes / 4 + (1 << 20); }

}  // namespace

absl::StatusOr<v1::RegionSlice> DeviceSlice(const std::string& region,
                                            const void* allocation_base,
                                            const void* data, uint64_t bytes) {
  const auto base = reinterpret_cast<uintptr_t>(allocation_base);
  const auto at = reinterpret_cast<uintptr_t>(data);
  if (at < base) {
    return absl::InvalidArgumentError(
        "the tensor's data lies before the allocation's base");
  }
  v1::RegionSlice slice;
  slice.set_region(region);
  slice.set_offset(at - base);
  slice.set_byte_size(bytes);
  return slice;
}

absl::Status Client::RegisterDeviceMemory(const std::string& name,
                                          const std::string& ipc_handle,
                                          const std::string& device,
                                          uint64_t byte_size) {
  v1::RegisterDeviceRegionRequest request;
  request.set_name(name);
  request.set_ipc_handle(ipc_handle);
  request.set_device(device);
  request.set_byte_size(byte_size);
  request.set_lease_seconds(options_.lease_seconds);
  v1::RegisterRegionResponse response;
  PACKD_RETURN_IF_ERROR(connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().RegisterDeviceRegion(c, request, &response);
  }));
  absl::MutexLock lock(&mu_);
  device_regions_[name] = std::move(request);
  ++registrations_[name];
  return absl::OkStatus();
}

absl::Status Client::RegisterSegment(SharedMemory& shm) {
  if (!shm.segment().linked()) {
    PACKD_RETURN_IF_ERROR(
        shm.segment().Relink(connection_->NewSegmentName(kSegmentTag).key));
  }
  return connection_->RegisterSegment(shm.segment(), shm.region());
}

absl::StatusOr<bool> Client::Reregister(
    const std::vector<std::string>& regions) {
  // How often each region of ours was registered before the server listed
  // its regions: a count that changed since was registered by another call.
  absl::flat_hash_map<std::string, int64_t> before;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& region : regions) {
      auto it = registrations_.find(region);
      if (it != registrations_.end()) before[region] = it->second;
    }
  }
  if (before.empty()) return false;
  v1::ListRegionsResponse listed;
  PACKD_RETURN_IF_ERROR(connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().ListRegions(c, v1::ListRegionsRequest(),
                                           &listed);
  }));
  absl::flat_hash_set<std::string> known;
  for (const v1::RegionInfo& info : listed.regions()) known.insert(info.name());
  bool missing = false;
  std::vector<std::string> mine;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [region, count] : before) {
      if (known.contains(region)) continue;
      missing = true;
      while (reregistering_.contains(region)) reregistered_.Wait(&mu_);
      if (registrations_[region] != count) continue;
      reregistering_.insert(region);
      mine.push_back(region);
    }
  }
  absl::Status status;
  for (const std::string& region : mine) {
    const absl::Status registered = RegisterAgain(region);
    absl::MutexLock lock(&mu_);
    reregistering_.erase(region);
    if (registered.ok()) ++registrations_[region];
    reregistered_.SignalAll();
    status.Update(registered);
  }
  PACKD_RETURN_IF_ERROR(status);
  return missing;
}

absl::Status Client::RegisterAgain(const std::string& region) {
  SharedMemory* segment = nullptr;
  std::optional<v1::RegisterDeviceRegionRequest> device;
  {
    absl::MutexLock lock(&mu_);
    for (SharedMemory* s : segments_) {
      if (s->region() == region) segment = s;
    }
    auto it = device_regions_.find(region);
    if (it != device_regions_.end()) device = it->second;
  }
  if (segment != nullptr) return RegisterSegment(*segment);
  if (!device.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("region \"", region, "\" is not this client's"));
  }
  v1::RegisterRegionResponse response;
  return connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().RegisterDeviceRegion(c, *device, &response);
  });
}

absl::StatusOr<std::unique_ptr<SharedMemory>> Client::CreateSharedMemory(
    int64_t bytes) {
  Connection::SegmentName name = connection_->NewSegmentName(kSegmentTag);
  const std::string region = name.region;
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<SharedMemory> shm,
      SharedMemory::Create(std::move(name.key), region, bytes, [this, region] {
        {
          absl::MutexLock lock(&mu_);
          segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                         [&](SharedMemory* s) {
                                           return s->region() == region;
                                         }),
                          segments_.end());
          registrations_.erase(region);
        }
        connection_->UnregisterRegion(region).IgnoreError();
      }));
  // On failure the segment goes (unlinked); the unregister it sends finds
  // nothing, harmlessly. No other call knows it yet: no lock is needed.
  PACKD_RETURN_IF_ERROR(RegisterSegment(*shm));
  absl::MutexLock lock(&mu_);
  segments_.push_back(shm.get());
  registrations_[region] = 1;
  return shm;
}

absl::StatusOr<Client::Scratch> Client::ScratchFor(int64_t bytes) {
  Scratch none(nullptr, ScratchReturn{this});
  if (options_.shared_memory_threshold_bytes <= 0 ||
      bytes < options_.shared_memory_threshold_bytes ||
      !IsNodeLocal(options_.address)) {
    return none;
  }
  std::optional<bool> allowed;
  {
    absl::MutexLock lock(&mu_);
    allowed = server_allows_shm_;
  }
  if (!allowed.has_value()) {
    PACKD_ASSIGN_OR_RETURN(v1::ServerInfo info, Info());
    allowed = info.shared_memory_enabled();
    absl::MutexLock lock(&mu_);
    server_allows_shm_ = allowed;
  }
  if (!*allowed) return none;
  std::unique_ptr<SharedMemory> segment;
  {
    // The smallest idle segment that holds the call.
    absl::MutexLock lock(&mu_);
    auto best = idle_scratch_.end();
    for (auto it = idle_scratch_.begin(); it != idle_scratch_.end(); ++it) {
      if ((*it)->size() >= bytes &&
          (best == idle_scratch_.end() || (*it)->size() < (*best)->size())) {
        best = it;
      }
    }
    if (best != idle_scratch_.end()) {
      segment = std::move(*best);
      idle_scratch_.erase(best);
    }
  }
  if (segment == nullptr) {
    PACKD_ASSIGN_OR_RETURN(segment, CreateSharedMemory(ScratchBytes(bytes)));
  }
  segment->Reset();
  return Scratch(segment.release(), ScratchReturn{this});
}

void Client::ScratchReturn::operator()(SharedMemory* segment) const {
  // Declared before the lock, so closed after it is released: closing takes
  // mu_ and unregisters.
  std::unique_ptr<SharedMemory> evicted;
  absl::MutexLock lock(&client->mu_);
  std::vector<std::unique_ptr<SharedMemory>>& idle = client->idle_scratch_;
  idle.emplace_back(segment);
  if (static_cast<int>(idle.size()) >
      std::max(client->options_.idle_scratch_segments, 0)) {
    auto smallest = std::min_element(
        idle.begin(), idle.end(),
        [](const auto& a, const auto& b) { return a->size() < b->size(); });
    evicted = std::move(*smallest);
    idle.erase(smallest);
  }
}

}  // namespace packd
