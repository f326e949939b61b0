#include "kernels/registry.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace packd {

Registry& Registry::Global() {
  static Registry* registry = [] {
    auto* r = new Registry;
    RegisterBuiltinBackends(*r);
    return r;
  }();
  return *registry;
}

absl::Status Registry::Add(DeviceKind kind, std::unique_ptr<Backend> backend,
                           bool make_default) {
  absl::MutexLock lock(&mu_);
  auto first_of_kind = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->kind != kind) continue;
    if (first_of_kind == entries_.end()) first_of_kind = it;
    if (it->backend->name() == backend->name()) {
      return absl::AlreadyExistsError(
          absl::StrCat("backend ", backend->name(), " is already registered"));
    }
  }
  Entry entry{kind, std::move(backend)};
  if (make_default && first_of_kind != entries_.end()) {
    entries_.insert(first_of_kind, std::move(entry));
  } else {
    entries_.push_back(std::move(entry));
  }
  return absl::OkStatus();
}

absl::Status Registry::MakeDefault(DeviceKind kind, absl::string_view name) {
  absl::MutexLock lock(&mu_);
  auto first_of_kind = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->kind != kind) continue;
    if (first_of_kind == entries_.end()) first_of_kind = it;
    if (it->backend->name() == name) {
      // Backends live behind unique_ptrs: moving entries keeps every Backend*
      // handed out valid.
      std::rotate(first_of_kind, it, it + 1);
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no backend named ", name, " to make the default"));
}

void Registry::SetRuntime(std::unique_ptr<DeviceRuntime> runtime) {
  absl::MutexLock lock(&mu_);
  runtimes_.push_back(std::move(runtime));
  gpus_.reset();
}

absl::StatusOr<DeviceRuntime*> Registry::FindRuntime(
    const Device& device) const {
  DeviceRuntime* runtime = nullptr;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& r : runtimes_) {
      if (r->kind() == device.kind) runtime = r.get();
    }
  }
  if (runtime == nullptr) {
    const char* what = device.kind == DeviceKind::kCuda  ? "CUDA"
                       : device.kind == DeviceKind::kHip ? "ROCm (HIP)"
                                                         : "CPU";
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.ToString(),
        " is not available: this build of packd has no ", what, " backend"));
  }
  PACKD_RETURN_IF_ERROR(runtime->CheckDevice(device));
  return runtime;
}

absl::StatusOr<Backend*> Registry::Find(const Device& device,
                                        absl::string_view impl) const {
  PACKD_RETURN_IF_ERROR(FindRuntime(device).status());
  return FindBackend(device, impl);
}

absl::StatusOr<Registry::ForCall> Registry::FindForCall(
    const Device& device, absl::string_view impl) const {
  ForCall out;
  PACKD_ASSIGN_OR_RETURN(out.runtime, FindRuntime(device));
  PACKD_ASSIGN_OR_RETURN(out.backend, FindBackend(device, impl));
  return out;
}

absl::StatusOr<Backend*> Registry::FindBackend(const Device& device,
                                               absl::string_view impl) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const Entry& e : entries_) {
    if (e.kind != device.kind) continue;
    if (impl.empty() || e.backend->name() == impl) return e.backend.get();
    names.emplace_back(e.backend->name());
  }
  return absl::NotFoundError(
      absl::StrCat("no implementation \"", impl, "\" on ", device.ToString(),
                   "; available: ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<Device> Registry::ResolveDevice(absl::string_view text,
                                               absl::string_view field) const {
  if (absl::StartsWith(text, "uuid:")) return FindByUuid(text.substr(5));
  return ParseDevice(text, field);
}

absl::StatusOr<Device> Registry::FindByUuid(absl::string_view uuid) const {
  const std::string wanted = CanonicalDeviceUuid(uuid);
  std::vector<DeviceInfo> gpus;
  {
    absl::MutexLock lock(&mu_);
    if (!gpus_.has_value()) {
      gpus_.emplace();
      for (DeviceKind kind : {DeviceKind::kCuda, DeviceKind::kHip}) {
        DeviceRuntime* runtime = nullptr;
        for (const auto& r : runtimes_) {
          if (r->kind() == kind) runtime = r.get();
        }
        if (runtime == nullptr) continue;
        for (DeviceInfo& info : runtime->ListDevices()) {
          gpus_->push_back(std::move(info));
        }
      }
    }
    gpus = *gpus_;
  }
  std::vector<std::string> known;
  for (const DeviceInfo& info : gpus) {
    if (!info.uuid.empty() && CanonicalDeviceUuid(info.uuid) == wanted) {
      PACKD_RETURN_IF_ERROR(FindRuntime(info.device).status());
      return info.device;
    }
    known.push_back(absl::StrCat(info.device.ToString(), " ", info.uuid));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "no device on this server has UUID ", wanted, " (it has ",
      known.empty() ? "no GPU" : absl::StrJoin(known, ", "),
      "): the client's GPU is not visible to packd; check the GPUs the pod "
      "or container is given"));
}

std::vector<std::string> Registry::Names(DeviceKind kind) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const Entry& e : entries_) {
    if (e.kind == kind) names.emplace_back(e.backend->name());
  }
  return names;
}

}  // namespace packd
