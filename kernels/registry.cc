#include "kernels/registry.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/status_macros.h"
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
#include "kernels/gpu/gpu_backend.h"
#endif
#ifdef PACKD_HAVE_TORCH
#include "kernels/torch/torch_backend.h"
#endif

namespace packd {

Registry& Registry::Global() {
  static Registry* registry = [] {
    auto* r = new Registry;
    r->SetRuntime(MakeHostRuntime());
    RegisterCpuBackends(*r);
#ifdef PACKD_HAVE_TORCH
    RegisterTorchBackends(*r);
#endif
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
    gpu::RegisterGpuBackends(*r);
#endif
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

void Registry::SetRuntime(std::unique_ptr<DeviceRuntime> runtime) {
  absl::MutexLock lock(&mu_);
  runtimes_.push_back(std::move(runtime));
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

std::vector<std::string> Registry::Names(DeviceKind kind) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const Entry& e : entries_) {
    if (e.kind == kind) names.emplace_back(e.backend->name());
  }
  return names;
}

}  // namespace packd
