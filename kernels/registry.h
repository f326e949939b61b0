// Registry: what this build can run on each kind of device — the op
// implementations (Backend), found by device and name, and the one
// DeviceRuntime of each kind.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(Backend* span, Registry::Get(Device::Cpu()));
//   PACKD_ASSIGN_OR_RETURN(Backend* native, Registry::Get(Device::Cpu(), "torch"));
//   PACKD_ASSIGN_OR_RETURN(DeviceRuntime* cuda, Registry::Runtime(Device{DeviceKind::kCuda, 0}));
// clang-format on
#ifndef PACKD_KERNELS_REGISTRY_H_
#define PACKD_KERNELS_REGISTRY_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/tensor_view.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"

namespace packd {

// Safe to share across threads: its lists are behind a mutex, and the
// backends and runtimes it hands out are themselves safe to share.
class Registry {
 public:
  // The process-wide registry, holding everything this build has: the host
  // runtime with "span" (default) and "torch" on cpu; the GPU runtime with
  // "gpu" on cuda or hip when built with them.
  static Registry& Global();

  // Shorthands for Global().Find(device, impl) and
  // Global().FindRuntime(device).
  static absl::StatusOr<Backend*> Get(const Device& device,
                                      absl::string_view impl = "") {
    return Global().Find(device, impl);
  }
  static absl::StatusOr<DeviceRuntime*> Runtime(const Device& device) {
    return Global().FindRuntime(device);
  }

  // Adds `backend` for `kind`; the first one added for a kind, or one added
  // with make_default, is the default. Returns ALREADY_EXISTS if that kind
  // already has a backend of that name.
  absl::Status Add(DeviceKind kind, std::unique_ptr<Backend> backend,
                   bool make_default = false);

  // Makes backend `name` of `kind` the default from now on (calls already
  // running keep theirs). NOT_FOUND when `kind` has no backend of that name.
  absl::Status MakeDefault(DeviceKind kind, absl::string_view name);

  // Makes `runtime` the runtime of its kind from now on. One it replaces stays
  // alive (pointers to it remain valid) but is no longer found.
  void SetRuntime(std::unique_ptr<DeviceRuntime> runtime);

  // Returns the implementation on `device` named `impl`, or the default when
  // `impl` is empty. FAILED_PRECONDITION when this build or this machine has
  // no such device; NOT_FOUND for an unknown impl.
  absl::StatusOr<Backend*> Find(const Device& device,
                                absl::string_view impl = "") const;

  // Returns the runtime of `device`'s kind once it has checked that the device
  // exists. FAILED_PRECONDITION saying why when this build or this machine has
  // no such device.
  absl::StatusOr<DeviceRuntime*> FindRuntime(const Device& device) const;

  // What a call on `device` runs with: its runtime and the implementation
  // `impl` (default when empty), with the device checked once. The errors of
  // FindRuntime and Find.
  struct ForCall {
    DeviceRuntime* runtime = nullptr;
    Backend* backend = nullptr;
  };
  absl::StatusOr<ForCall> FindForCall(const Device& device,
                                      absl::string_view impl = "") const;

  // The device a request names: "cpu", "cuda:N", "hip:N" (ParseDevice), or
  // "uuid:GPU-..." for the GPU of that UUID, whatever this process's index
  // for it. INVALID_ARGUMENT naming `field` for malformed text;
  // FAILED_PRECONDITION naming the UUID when no device here has it.
  absl::StatusOr<Device> ResolveDevice(
      absl::string_view text, absl::string_view field = "device") const;
  // The GPU whose UUID is `uuid` (with or without "GPU-", any case);
  // FAILED_PRECONDITION naming it and the UUIDs this machine has.
  absl::StatusOr<Device> FindByUuid(absl::string_view uuid) const;

  // Names of the implementations for `kind`, the default first.
  std::vector<std::string> Names(DeviceKind kind) const;

 private:
  // Find without the device check.
  absl::StatusOr<Backend*> FindBackend(const Device& device,
                                       absl::string_view impl) const;

  struct Entry {
    DeviceKind kind;
    std::unique_ptr<Backend> backend;
  };
  mutable absl::Mutex mu_;
  // Defaults first within a kind.
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  // The current runtime of a kind is the last one of that kind.
  std::vector<std::unique_ptr<DeviceRuntime>> runtimes_ ABSL_GUARDED_BY(mu_);
  // The GPUs of the current runtimes with their UUIDs, listed once (devices
  // do not change while a process runs); reset by SetRuntime.
  mutable std::optional<std::vector<DeviceInfo>> gpus_ ABSL_GUARDED_BY(mu_);
};

// Adds what this build was compiled with to `registry`: the host runtime with
// the CPU backends, then libtorch's, CUDA's or HIP's where built. The one list
// of them is kernels/builtin_backends.cc, so that the registry itself names no
// backend; Global() calls it once.
void RegisterBuiltinBackends(Registry& registry);

}  // namespace packd

#endif  // PACKD_KERNELS_REGISTRY_H_
