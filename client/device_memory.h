// DeviceMemory: what the client needs of a GPU runtime to keep a call's
// tensors on their GPU. A call whose tensors are all on one GPU registers the
// allocations holding them as device regions (packd opens them from their IPC
// handles), allocates its results on that GPU, and has packd write them there:
// no tensor byte crosses the host. MakeCudaDeviceMemory() serves libtorch's
// CUDA tensors through the CUDA runtime; tests give the client memory of
// packd's fake GPU instead (tests/client/fake_gpu_memory.h).
//
// clang-format off
//   ClientOptions options;
//   options.device_memory = MakeCudaDeviceMemory();  // the default
// clang-format on
#ifndef PACKD_CLIENT_DEVICE_MEMORY_H_
#define PACKD_CLIENT_DEVICE_MEMORY_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace packd {

// Devices are this process's indices; packd is told their UUIDs. Safe to
// share across threads: a client calls it from every thread that calls it.
class DeviceMemory {
 public:
  // The allocation a tensor's bytes lie in: an IPC handle maps it whole, from
  // its start.
  struct Allocation {
    uintptr_t base = 0;
    uint64_t size = 0;
    std::string ipc_handle;  // 64 bytes
  };

  virtual ~DeviceMemory() = default;

  // The GPU holding `t`, or nullopt for host memory.
  virtual std::optional<int> DeviceOf(const at::Tensor& t) const = 0;
  // The device as messages name it: "cuda:0".
  virtual std::string Name(int index) const = 0;
  // "GPU-8f3c...": the device's name in every process.
  virtual absl::StatusOr<std::string> Uuid(int index) const = 0;
  // The allocation holding `t`'s bytes (t has at least one).
  virtual absl::StatusOr<Allocation> AllocationOf(
      const at::Tensor& t) const = 0;
  // An uninitialised tensor on GPU `index`.
  virtual absl::StatusOr<at::Tensor> Empty(at::IntArrayRef shape,
                                           at::ScalarType dtype,
                                           int index) const = 0;
  // A host tensor's copy on GPU `index` (cu_seqlens and the like).
  virtual absl::StatusOr<at::Tensor> ToDevice(const at::Tensor& host,
                                              int index) const = 0;
  // Returns once the work queued on GPU `index` so far has finished: the
  // inputs are written and the results' memory is free before packd, another
  // process, touches them.
  virtual absl::Status Synchronize(int index) const = 0;
  // Calls `freed` once the allocation at `base` is freed, where the runtime
  // can tell; the default cannot.
  virtual void Watch(uintptr_t base, std::function<void()> freed) const {}
};

// libtorch's CUDA tensors through the CUDA runtime (results from libtorch's
// caching allocator); null where the client was built without CUDA. With
// libtorch 2.1 or later with CUDA it watches the allocator and says when a
// segment is freed (Watch); elsewhere the allocator says nothing, so the
// region of a freed allocation goes when its address comes back as another
// allocation (its IPC handle differs), when its lease runs out, or with the
// client.
std::shared_ptr<DeviceMemory> MakeCudaDeviceMemory();

}  // namespace packd

#endif  // PACKD_CLIENT_DEVICE_MEMORY_H_
