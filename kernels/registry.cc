#include "kernels/registry.h"

#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/cpu_backend.h"
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
#include "kernels/gpu/gpu_backend.h"
#endif
#ifdef PACKD_HAVE_TORCH
#include "kernels/torch/torch_backend.h"
#endif

namespace packd {

absl::Status Backend::CheckDevice(const Device& device) const {
  if (device.kind == DeviceKind::kCpu && device.index == 0)
    return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("device ", device.ToString(), " is not available"));
}

absl::StatusOr<Buffer> Backend::Allocate(int64_t bytes, const Device& device) {
  if (device.kind != DeviceKind::kCpu) {
    return absl::FailedPreconditionError(absl::StrCat(
        "backend ", name(), " cannot allocate on ", device.ToString()));
  }
  return HostBufferPool::Global().Acquire(static_cast<size_t>(bytes));
}

absl::StatusOr<DeviceMapping> Backend::OpenIpcMemory(absl::string_view,
                                                     const Device& device,
                                                     uint64_t) {
  return absl::FailedPreconditionError(absl::StrCat(
      "backend ", name(), " cannot open IPC memory on ", device.ToString()));
}

absl::Status Backend::CopyToDevice(void* dst, const void* src, int64_t bytes,
                                   const Device&) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status Backend::CopyToHost(void* dst, const void* src, int64_t bytes,
                                 const Device&) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

Registry& Registry::Global() {
  static Registry* registry = [] {
    auto* r = new Registry;
    RegisterCpuBackends(*r);
#ifdef PACKD_HAVE_TORCH
    RegisterTorchBackends(*r);
#endif
#if defined(PACKD_HAVE_CUDA) || defined(PACKD_HAVE_HIP)
    RegisterGpuBackends(*r);
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

absl::StatusOr<Backend*> Registry::Find(absl::string_view op,
                                        const Device& device,
                                        absl::string_view impl) const {
  if (op != "pack" && op != "scatter") {
    return absl::InvalidArgumentError(absl::StrCat(
        "op \"", op, "\" is not known: expected \"pack\" or \"scatter\""));
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const Entry& e : entries_) {
    if (e.kind != device.kind) continue;
    if (impl.empty() || e.backend->name() == impl) {
      absl::Status available = e.backend->CheckDevice(device);
      if (!available.ok()) return available;
      return e.backend.get();
    }
    names.emplace_back(e.backend->name());
  }
  if (names.empty()) {
    const char* what = device.kind == DeviceKind::kCuda  ? "CUDA"
                       : device.kind == DeviceKind::kHip ? "ROCm (HIP)"
                                                         : "CPU";
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.ToString(),
        " is not available: this build of packd has no ", what, " backend"));
  }
  return absl::NotFoundError(absl::StrCat(
      "no implementation \"", impl, "\" of ", op, " on ", device.ToString(),
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
