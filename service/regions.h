// Regions: the tensor handles of packd. A region is a named, registered span of
// memory the client shares with the server — a POSIX shared-memory object on
// this node, or GPU memory exported with an IPC handle — so that large tensors
// never cross the gRPC byte stream.
//
// clang-format off
// Regions belong to the tenant that registered it (docs/design.md §15): each
// tenant sees only its own, and another's is NOT_FOUND as if absent.
//
// clang-format off
//   RegionRegistry regions({.enabled = true, .key_prefix = "/packd"});
//   PACKD_RETURN_IF_ERROR(regions.RegisterSystem(tenant, "hidden", "/packd_w0", 0, 128 << 20));
//   PACKD_ASSIGN_OR_RETURN(ResolvedSlice s, regions.Resolve(tenant, slice, "inputs[0]"));
// clang-format on
#ifndef PACKD_SERVICE_REGIONS_H_
#define PACKD_SERVICE_REGIONS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "service/tenant.h"

namespace packd {

// One registered mapping. Calls that use it hold a shared_ptr, so unregistering
// a region in use defers its unmap until the last such call ends. Safe to
// share across threads: only its lease's last use changes, atomically.
class Region {
 public:
  // `identity` tells a repeat of the registration that made it (same key,
  // offset and size, or same IPC handle, device and size) from a clash.
  Region(std::string name, std::string kind, Device device, char* base,
         uint64_t byte_size, std::shared_ptr<void> mapping,
         uint32_t lease_seconds = 0, std::string identity = "")
      : name_(std::move(name)),
        kind_(std::move(kind)),
        identity_(std::move(identity)),
        device_(device),
        base_(base),
        byte_size_(byte_size),
        mapping_(std::move(mapping)),
        lease_seconds_(lease_seconds) {
    Renew();
  }

  const std::string& name() const { return name_; }
  const std::string& kind() const { return kind_; }  // "system" or "device"
  const std::string& identity() const { return identity_; }
  const Device& device() const { return device_; }
  char* base() const { return base_; }
  uint64_t byte_size() const { return byte_size_; }
  uint32_t lease_seconds() const { return lease_seconds_; }

  // A call named the region now: its lease starts again.
  void Renew() {
    named_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  }
  // Whether its lease has run out at `now_ns` (never without a lease).
  bool Expired(int64_t now_ns) const {
    return lease_seconds_ > 0 &&
           now_ns - named_ns_.load(std::memory_order_relaxed) >
               int64_t{lease_seconds_} * 1000000000;
  }

 private:
  const std::string name_;
  const std::string kind_;
  const std::string identity_;
  const Device device_;
  char* const base_;
  const uint64_t byte_size_;
  const std::shared_ptr<void> mapping_;  // unmaps when the last holder lets go
  const uint32_t lease_seconds_;
  std::atomic<int64_t> named_ns_{0};  // when a call last named it
};

// A slice resolved to memory, holding its region alive.
struct ResolvedSlice {
  std::shared_ptr<Region> region;
  char* data = nullptr;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

struct RegionOptions {
  // Whether tensor handles are allowed at all (--shared_memory).
  bool enabled = false;
  // Every system region key must start with this (--shm_key_prefix), then
  // its tenant's label and a dot for a named tenant (Tenant::KeyPrefix).
  std::string key_prefix = "/packd";
  // How often leases are checked; a region outlives its lease by at most this.
  absl::Duration lease_check_interval = absl::Milliseconds(250);
  // Whether named tenants share the prefix with the anonymous one (packd
  // names unix-socket peers by uid while others stay anonymous): then an
  // anonymous key may not hold a '.' after the prefix, so that it never
  // names a named tenant's segment.
  bool anonymous_beside_named = false;
  // The most regions one tenant may hold at once (--max_regions_per_tenant);
  // 0: no bound.
  int64_t max_regions_per_tenant = 4096;
};

// Safe to share across threads: every method may be called from several at
// once, and the lease thread ends expired regions beside them.
class RegionRegistry {
 public:
  static constexpr size_t kMaxNameLength = 256;

  // Starts the thread that ends expired leases when handles are enabled.
  explicit RegionRegistry(RegionOptions options);
  ~RegionRegistry();
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  bool enabled() const { return options_.enabled; }
  // OK when handles are enabled; FAILED_PRECONDITION saying how to enable them.
  absl::Status CheckEnabled() const;

  // Maps [offset, offset + byte_size) of the shared-memory object `key`,
  // read-write. FAILED_PRECONDITION when handles are disabled; INVALID_ARGUMENT
  // for a bad name or key, a key outside the prefix, a zero size, or a range
  // past the object's end (or overflowing); NOT_FOUND when no such object
  // exists; ALREADY_EXISTS when the name is taken by another registration.
  // A repeat of the registration that holds the name (same key, offset and
  // size: a client retrying after a lost reply) succeeds and renews the lease.
  // With `lease_seconds` > 0 the region is unregistered once no call has named
  // it for that long.
  // For `tenant`: PERMISSION_DENIED naming the key and the rule for a key
  // inside --shm_key_prefix but outside the tenant's own prefix, or (a
  // unix-socket peer) an object another uid owns; RESOURCE_EXHAUSTED past
  // max_regions_per_tenant. An object is mapped once however many regions
  // name it (by its device and inode).
  absl::Status RegisterSystem(const Tenant& tenant, const std::string& name,
                              const std::string& key, uint64_t offset,
                              uint64_t byte_size, uint32_t lease_seconds = 0);

  // Adds an already opened device mapping (the GPU backend opens IPC handles)
  // whose registration is `identity` (DeviceIdentity). Errors as
  // RegisterSystem's; a repeat of the registration holding the name succeeds.
  absl::Status RegisterDevice(const Tenant& tenant, const std::string& name,
                              Device device, char* base, uint64_t byte_size,
                              std::shared_ptr<void> mapping,
                              uint32_t lease_seconds = 0,
                              std::string identity = "");

  // Whether `name` is registered as `identity` (then its lease is renewed):
  // true; false when the name is free; ALREADY_EXISTS when another
  // registration holds it. Lets a repeated register call succeed without
  // mapping the memory twice.
  absl::StatusOr<bool> HeldAs(const Tenant& tenant, const std::string& name,
                              const std::string& identity) const;
  // The identities of a system and a device registration.
  static std::string SystemIdentity(const std::string& key, uint64_t offset,
                                    uint64_t byte_size);
  static std::string DeviceIdentity(const std::string& ipc_handle,
                                    const Device& device, uint64_t byte_size);

  // NOT_FOUND when the tenant has no region of that name. The memory is
  // unmapped once no call uses it.
  absl::Status Unregister(const Tenant& tenant, const std::string& name);

  // The tenant's regions, by name.
  std::vector<v1::RegionInfo> List(const Tenant& tenant) const;
  // Regions registered now; of one kind ("system", "device").
  int64_t size() const;
  int64_t size(absl::string_view kind) const;

  // Unregisters every region whose lease ran out at `now_ns` and that no call
  // holds; returns how many. The lease thread calls it; so may tests.
  int64_t ExpireLeases(int64_t now_ns);
  // Regions unregistered because their lease ran out, since start.
  int64_t expired() const { return expired_.load(std::memory_order_relaxed); }

  // Checks `slice` against its region, overflow-safe, before any byte moves,
  // and renews the region's lease.
  // FAILED_PRECONDITION when handles are disabled; NOT_FOUND for an
  // region the tenant has not registered (another tenant's included, word for
  // word, and renewing nothing); INVALID_ARGUMENT naming `field` when the
  // slice passes the region's end.
  absl::StatusOr<ResolvedSlice> Resolve(const Tenant& tenant,
                                        const v1::RegionSlice& slice,
                                        absl::string_view field) const;
  // The key prefix `tenant`'s segments must begin with.
  std::string KeyPrefix(const Tenant& tenant) const {
    return tenant.KeyPrefix(options_.key_prefix);
  }

  // OK for a name packd accepts: 1 to 256 characters, each a letter, a digit
  // or one of `._-:/`.
  static absl::Status ValidateName(absl::string_view name);
  // OK for a POSIX shared-memory name: "/" then letters, digits, '.', '_', '-'
  // (not "." or ".."), at most 255 characters, starting with `prefix`.
  static absl::Status ValidateKey(absl::string_view key,
                                  absl::string_view prefix);

 private:
  using Key = std::pair<std::string, std::string>;  // tenant, region name
  // A shared-memory object mapped whole, by its device and inode.
  struct Mapped {
    char* base = nullptr;
    uint64_t length = 0;
    std::weak_ptr<void> owner;
  };

  absl::Status Add(const Tenant& tenant, std::shared_ptr<Region> region);
  // OK when `tenant` may name `key` (its own prefix; a unix-socket peer's
  // object is checked when opened).
  absl::Status CheckKeyOwner(const Tenant& tenant,
                             const std::string& key) const;
  // [offset, end) of `key`, from the object's one mapping.
  absl::StatusOr<std::pair<char*, std::shared_ptr<void>>> Map(
      const Tenant& tenant, const std::string& name, const std::string& key,
      uint64_t offset, uint64_t end);

  const RegionOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, std::shared_ptr<Region>> regions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::Mutex map_mu_;  // taken before mu_, never after
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, Mapped> mapped_
      ABSL_GUARDED_BY(map_mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> expired_{0};
  std::thread lease_thread_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_REGIONS_H_
