#include "service/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace packd {

absl::Status RegionRegistry::ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("region name \"", name.substr(0, 64), "\" must have 1 to ",
                     kMaxNameLength, " characters, not ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                    c == '-' || c == ':' || c == '/';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("region name \"", name,
                       "\" may hold only letters, digits and . _ - : /"));
    }
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::ValidateKey(absl::string_view key,
                                         absl::string_view prefix) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("key \"", key, "\" is not a shared-memory name: ", why));
  };
  if (key.size() < 2 || key[0] != '/')
    return bad("it must be \"/\" then a name");
  if (key.size() > 255) return bad("it is longer than 255 characters");
  const absl::string_view rest = key.substr(1);
  if (rest == "." || rest == "..") return bad("\".\" and \"..\" are not names");
  for (char c : rest) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok)
      return bad("only letters, digits, '.', '_' and '-' may follow '/'");
  }
  if (!absl::StartsWith(key, prefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key \"", key, "\" does not start with the server's key prefix \"",
        prefix, "\" (--shm_key_prefix)"));
  }
  return absl::OkStatus();
}

RegionRegistry::RegionRegistry(RegionOptions options)
    : options_(std::move(options)) {
  if (!options_.enabled) return;
  lease_thread_ = std::thread([this] {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                                 options_.lease_check_interval)) {
          return;
        }
      }
      ExpireLeases(absl::GetCurrentTimeNanos());
    }
  });
}

RegionRegistry::~RegionRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
}

int64_t RegionRegistry::ExpireLeases(int64_t now_ns) {
  std::vector<std::shared_ptr<Region>> ended;  // unmapped outside the lock
  {
    absl::MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      // use_count 1: only the registry holds it, no call is using it.
      if (it->second->Expired(now_ns) && it->second.use_count() == 1) {
        ended.push_back(std::move(it->second));
        --per_tenant_[it->first.first];
        regions_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  expired_.fetch_add(static_cast<int64_t>(ended.size()),
                     std::memory_order_relaxed);
  return static_cast<int64_t>(ended.size());
}

int64_t RegionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

int64_t RegionRegistry::size(absl::string_view kind) const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [key, region] : regions_) n += region->kind() == kind;
  return n;
}

absl::Status RegionRegistry::CheckEnabled() const {
  if (options_.enabled) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "tensor handles are disabled on this server (--shared_memory=off, or "
      "auto on a listener that is not loopback or a unix socket); send "
      "tensors inline");
}

absl::Status RegionRegistry::CheckKeyOwner(const Tenant& tenant,
                                           const std::string& key) const {
  const std::string prefix = KeyPrefix(tenant);
  if (!absl::StartsWith(key, prefix)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "key \"", key, "\" is outside the key prefix \"", prefix,
        "\" of this caller (tenant ", tenant.name,
        "): a caller registers only segments under its own prefix, which "
        "GetServerInfo reports (shm_key_prefix)"));
  }
  if (tenant.anonymous() && options_.anonymous_beside_named &&
      key.find('.', prefix.size()) != std::string::npos) {
    return absl::PermissionDeniedError(absl::StrCat(
        "key \"", key, "\" holds a '.' after the key prefix \"", prefix,
        "\": such keys name the segments of named tenants (unix-socket "
        "peers), which an anonymous caller may not register"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<char*, std::shared_ptr<void>>> RegionRegistry::Map(
    const Tenant& tenant, const std::string& name, const std::string& key,
    uint64_t offset, uint64_t end) {
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("cannot open shared memory \"", key,
                                         "\": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    if (err == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("fstat of \"", key, "\": ", std::strerror(err)));
  }
  // packd opens with its own rights what a peer names: a unix-socket peer
  // may name only its own objects (root's may name any).
  if (tenant.uid.has_value() && *tenant.uid != 0 && st.st_uid != *tenant.uid) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "key \"", key, "\" is a segment of uid ", st.st_uid,
        ", not of this caller (uid ", *tenant.uid,
        "): packd opens for a unix-socket peer only the segments it owns"));
  }
  if (end > static_cast<uint64_t>(st.st_size)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", name, "\": [", offset, ", ", end, ") passes the end of \"",
        key, "\", which has ", st.st_size, " bytes"));
  }
  // The object mapped whole, once, however many regions name it: a
  // registration costs no new mapping (the kernel's count of them is
  // bounded, vm.max_map_count). tmpfs numbers inodes from a counter, so a
  // live mapping's (device, inode) is its object's.
  absl::MutexLock lock(&map_mu_);
  const std::pair<uint64_t, uint64_t> id(st.st_dev, st.st_ino);
  auto found = mapped_.find(id);
  std::shared_ptr<void> owner;
  if (found != mapped_.end()) owner = found->second.owner.lock();
  if (owner == nullptr || found->second.length < end) {
    const size_t length = static_cast<size_t>(st.st_size);
    void* mapped =
        mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (mapped == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mmap of \"", key, "\": ", std::strerror(err)));
    }
    owner =
        std::shared_ptr<void>(mapped, [length](void* p) { munmap(p, length); });
    // Entries whose mappings are gone go first: the map stays as large as
    // the objects mapped now.
    absl::erase_if(mapped_, [](const auto& entry) {
      return entry.second.owner.expired();
    });
    mapped_[id] = Mapped{static_cast<char*>(mapped), length, owner};
    return std::make_pair(static_cast<char*>(mapped) + offset, owner);
  }
  close(fd);  // the mapping keeps the object alive; no descriptor is left open
  return std::make_pair(found->second.base + offset, owner);
}

absl::Status RegionRegistry::RegisterSystem(const Tenant& tenant,
                                            const std::string& name,
                                            const std::string& key,
                                            uint64_t offset, uint64_t byte_size,
                                            uint32_t lease_seconds) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (absl::Status s = ValidateKey(key, options_.key_prefix); !s.ok()) return s;
  if (absl::Status s = CheckKeyOwner(tenant, key); !s.ok()) return s;
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("region \"", name, "\": byte_size must be positive"));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, byte_size, &end) ||
      end > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region \"", name, "\": offset ", offset, " + byte_size ",
                     byte_size, " overflows"));
  }
  std::string identity = SystemIdentity(key, offset, byte_size);
  PACKD_ASSIGN_OR_RETURN(const bool held, HeldAs(tenant, name, identity));
  if (held) return absl::OkStatus();
  PACKD_ASSIGN_OR_RETURN(auto mapping, Map(tenant, name, key, offset, end));
  return Add(tenant, std::make_shared<Region>(
                         name, "system", Device::Cpu(), mapping.first,
                         byte_size, std::move(mapping.second), lease_seconds,
                         std::move(identity)));
}

std::string RegionRegistry::SystemIdentity(const std::string& key,
                                           uint64_t offset,
                                           uint64_t byte_size) {
  return absl::StrCat("system ", key, " ", offset, " ", byte_size);
}

std::string RegionRegistry::DeviceIdentity(const std::string& ipc_handle,
                                           const Device& device,
                                           uint64_t byte_size) {
  return absl::StrCat("device ", absl::BytesToHexString(ipc_handle), " ",
                      device.ToString(), " ", byte_size);
}

absl::StatusOr<bool> RegionRegistry::HeldAs(const Tenant& tenant,
                                            const std::string& name,
                                            const std::string& identity) const {
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(Key(tenant.name, name));
    if (it == regions_.end()) return false;
    region = it->second;
  }
  if (identity.empty() || region->identity() != identity) {
    return absl::AlreadyExistsError(
        absl::StrCat("region \"", name, "\" is already registered"));
  }
  region->Renew();
  return true;
}

absl::Status RegionRegistry::RegisterDevice(
    const Tenant& tenant, const std::string& name, Device device, char* base,
    uint64_t byte_size, std::shared_ptr<void> mapping, uint32_t lease_seconds,
    std::string identity) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  return Add(tenant,
             std::make_shared<Region>(name, "device", device, base, byte_size,
                                      std::move(mapping), lease_seconds,
                                      std::move(identity)));
}

absl::Status RegionRegistry::Add(const Tenant& tenant,
                                 std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  const std::string name = region->name();
  const Key key(tenant.name, name);
  if (auto it = regions_.find(key); it != regions_.end()) {
    // Two copies of one registration racing: the second finds the first's.
    if (region->identity().empty() ||
        it->second->identity() != region->identity()) {
      return absl::AlreadyExistsError(
          absl::StrCat("region \"", name, "\" is already registered"));
    }
    return absl::OkStatus();
  }
  int64_t& held = per_tenant_[tenant.name];
  if (options_.max_regions_per_tenant > 0 &&
      held >= options_.max_regions_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", tenant.name, " holds ", held, " regions, the most one may ",
        "(--max_regions_per_tenant=", options_.max_regions_per_tenant,
        "): unregister some, or give them leases"));
  }
  ++held;
  regions_.emplace(key, std::move(region));
  return absl::OkStatus();
}

absl::Status RegionRegistry::Unregister(const Tenant& tenant,
                                        const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(Key(tenant.name, name));
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("region \"", name, "\" is not registered"));
    }
    region = std::move(it->second);
    --per_tenant_[tenant.name];
    regions_.erase(it);
  }
  // Unmapped here, or when the last call using it ends.
  return absl::OkStatus();
}

std::vector<v1::RegionInfo> RegionRegistry::List(const Tenant& tenant) const {
  std::vector<v1::RegionInfo> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, region] : regions_) {
      if (key.first != tenant.name) continue;
      const std::string& name = key.second;
      v1::RegionInfo info;
      info.set_name(name);
      info.set_kind(region->kind());
      info.set_byte_size(region->byte_size());
      info.set_device(region->device().ToString());
      info.set_lease_seconds(region->lease_seconds());
      out.push_back(std::move(info));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.name() < b.name(); });
  return out;
}

absl::StatusOr<ResolvedSlice> RegionRegistry::Resolve(
    const Tenant& tenant, const v1::RegionSlice& slice,
    absl::string_view field) const {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(Key(tenant.name, slice.region()));
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(
          field, ": region \"", slice.region(), "\" is not registered"));
    }
    region = it->second;
  }
  region->Renew();
  uint64_t end = 0;
  if (__builtin_add_overflow(slice.offset(), slice.byte_size(), &end) ||
      end > region->byte_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": slice [", slice.offset(), ", +",
                     slice.byte_size(), ") passes the end of region \"",
                     slice.region(), "\" (", region->byte_size(), " bytes)"));
  }
  ResolvedSlice out;
  out.data = region->base() + slice.offset();
  out.offset = slice.offset();
  out.byte_size = slice.byte_size();
  out.region = std::move(region);
  return out;
}

}  // namespace packd
