#include "server/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace packd {

namespace {

// [offset, end) of the shared-memory object `key`, mapped read-write: `base`
// points at `offset`; `owner` unmaps when the last holder lets go.
struct SharedMapping {
  char* base = nullptr;
  std::shared_ptr<void> owner;
};

// Maps [offset, end) of `key` for region `name` (for messages). NOT_FOUND
// when no such object exists; PERMISSION_DENIED when it may not be opened;
// INVALID_ARGUMENT when the range passes its end; RESOURCE_EXHAUSTED when
// mmap fails.
absl::StatusOr<SharedMapping> MapSharedMemory(const std::string& name,
                                              const std::string& key,
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
  if (end > static_cast<uint64_t>(st.st_size)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", name, "\": [", offset, ", ", end, ") passes the end of \"",
        key, "\", which has ", st.st_size, " bytes"));
  }
  // mmap offsets must be page-aligned: map from the page holding `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = offset / page * page;
  const size_t map_length = static_cast<size_t>(end - map_offset);
  void* mapped = mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED,
                      fd, static_cast<off_t>(map_offset));
  const int err = errno;
  close(fd);  // the mapping keeps the object alive; no descriptor is left open
  if (mapped == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of \"", key, "\": ", std::strerror(err)));
  }
  SharedMapping mapping;
  mapping.owner = std::shared_ptr<void>(
      mapped, [map_length](void* p) { munmap(p, map_length); });
  mapping.base = static_cast<char*>(mapped) + (offset - map_offset);
  return mapping;
}

}  // namespace

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
  for (const auto& [name, region] : regions_) n += region->kind() == kind;
  return n;
}

absl::Status RegionRegistry::CheckEnabled() const {
  if (options_.enabled) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "tensor handles are disabled on this server (--shared_memory=off, or "
      "auto on a listener that is not loopback or a unix socket); send "
      "tensors inline");
}

absl::Status RegionRegistry::RegisterSystem(const std::string& name,
                                            const std::string& key,
                                            uint64_t offset, uint64_t byte_size,
                                            uint32_t lease_seconds) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (absl::Status s = ValidateKey(key, options_.key_prefix); !s.ok()) return s;
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
  PACKD_ASSIGN_OR_RETURN(const bool held, HeldAs(name, identity));
  if (held) return absl::OkStatus();
  PACKD_ASSIGN_OR_RETURN(SharedMapping mapping,
                         MapSharedMemory(name, key, offset, end));
  return Add(std::make_shared<Region>(
      name, "system", Device::Cpu(), mapping.base, byte_size,
      std::move(mapping.owner), lease_seconds, std::move(identity)));
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

absl::StatusOr<bool> RegionRegistry::HeldAs(const std::string& name,
                                            const std::string& identity) const {
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
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

absl::Status RegionRegistry::RegisterDevice(const std::string& name,
                                            Device device, char* base,
                                            uint64_t byte_size,
                                            std::shared_ptr<void> mapping,
                                            uint32_t lease_seconds,
                                            std::string identity) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  return Add(std::make_shared<Region>(name, "device", device, base, byte_size,
                                      std::move(mapping), lease_seconds,
                                      std::move(identity)));
}

absl::Status RegionRegistry::Add(std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  const std::string name = region->name();
  auto [it, added] = regions_.emplace(name, region);
  // Two copies of one registration racing: the second finds the first's.
  if (!added && (region->identity().empty() ||
                 it->second->identity() != region->identity())) {
    return absl::AlreadyExistsError(
        absl::StrCat("region \"", name, "\" is already registered"));
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::Unregister(const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("region \"", name, "\" is not registered"));
    }
    region = std::move(it->second);
    regions_.erase(it);
  }
  // Unmapped here, or when the last call using it ends.
  return absl::OkStatus();
}

std::vector<v1::RegionInfo> RegionRegistry::List() const {
  std::vector<v1::RegionInfo> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, region] : regions_) {
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
    const v1::RegionSlice& slice, absl::string_view field) const {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(slice.region());
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
