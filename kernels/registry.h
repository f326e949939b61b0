// Registry: (op, device, implementation name) -> Backend, the C++ counterpart
// of kernel_registry.get_op("pack").
//
//   PACKD_ASSIGN_OR_RETURN(Backend* pack, Registry::Get("pack",
//   Device::Cpu())); PACKD_ASSIGN_OR_RETURN(Backend* native,
//   Registry::Get("pack", Device::Cpu(), "torch"));
#ifndef PACKD_KERNELS_REGISTRY_H_
#define PACKD_KERNELS_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/tensor_view.h"

namespace packd {

class Registry {
 public:
  // The process-wide registry, holding every backend this build has: "span"
  // (default) and "torch" on cpu; "gpu" on cuda or hip when built with them.
  static Registry& Global();

  // Shorthand for Global().Find(op, device, impl).
  static absl::StatusOr<Backend*> Get(absl::string_view op,
                                      const Device& device,
                                      absl::string_view impl = "") {
    return Global().Find(op, device, impl);
  }

  // Adds `backend` for `kind`; the first one added for a kind, or one added
  // with make_default, is the default. Returns ALREADY_EXISTS if that kind
  // already has a backend of that name.
  absl::Status Add(DeviceKind kind, std::unique_ptr<Backend> backend,
                   bool make_default = false);

  // Returns the backend for `op` ("pack" or "scatter") on `device`: the one
  // named `impl`, or the default when `impl` is empty. INVALID_ARGUMENT for
  // another op name; NOT_FOUND for an unknown impl; FAILED_PRECONDITION when
  // this build or this machine has no such device.
  absl::StatusOr<Backend*> Find(absl::string_view op, const Device& device,
                                absl::string_view impl = "") const;

  // Names of the implementations for `kind`, the default first.
  std::vector<std::string> Names(DeviceKind kind) const;

 private:
  struct Entry {
    DeviceKind kind;
    std::unique_ptr<Backend> backend;
  };
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_
      ABSL_GUARDED_BY(mu_);  // defaults first within a kind
};

}  // namespace packd

#endif  // PACKD_KERNELS_REGISTRY_H_
