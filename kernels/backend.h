// Backend: one implementation of the pack and scatter ops for one kind of
// device, as the registry holds it. Pack() and Scatter() in kernels/pack.h
// validate every argument and then call a backend; backends trust their inputs.
//
//   PACKD_ASSIGN_OR_RETURN(auto plan, backend->Plan(mask));
//   PACKD_RETURN_IF_ERROR(backend->Gather(*plan, x, out));
#ifndef PACKD_KERNELS_BACKEND_H_
#define PACKD_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/buffer.h"
#include "kernels/tensor_view.h"

namespace packd {

// What one scan of a [B, S] mask learns, on the host, plus whatever a backend
// keeps to gather and scatter with (subclasses). Computed once per request and
// reused for every tensor in it.
class MaskPlan {
 public:
  virtual ~MaskPlan() = default;

  int64_t batch = 0;                // B
  int64_t seq = 0;                  // S
  std::vector<int64_t> cu_seqlens;  // [B + 1]: 0, then running active counts
  std::vector<int64_t>
      last_index;  // [B]: s of each row's last active position, -1 if none

  int64_t total_active() const { return cu_seqlens.back(); }
  bool all_active() const { return total_active() == batch * seq; }
};

// Device memory another process exported, opened in this one: `owner` closes it
// when the last holder lets go.
struct DeviceMapping {
  void* base = nullptr;
  std::shared_ptr<void> owner;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // The implementation's name within its device kind ("span", "torch", "cuda").
  virtual absl::string_view name() const = 0;

  // OK when `device` (of this backend's kind) exists on this machine;
  // FAILED_PRECONDITION saying why not otherwise.
  virtual absl::Status CheckDevice(const Device& device) const;

  // Scans `mask` ([B, S], any dtype, nonzero is active: NaN is active, -0.0 is
  // not). Returns the plan, or INTERNAL with the runtime's message if a device
  // runtime fails.
  virtual absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(
      const TensorView& mask) = 0;

  // out = x[mask != 0]: x is [B, S, *tail], out is [total_active, *tail] of the
  // same dtype, neither overlapping. Writes every byte of `out`.
  virtual absl::Status Gather(const MaskPlan& plan, const TensorView& x,
                              const TensorView& out) = 0;

  // The inverse: dense[b, s] = packed[rank] at active positions, zeros
  // elsewhere. Writes every byte of `dense`.
  virtual absl::Status Scatter(const MaskPlan& plan, const TensorView& packed,
                               const TensorView& dense) = 0;

  // Returns `bytes` of uninitialised memory on `device` for a result.
  // RESOURCE_EXHAUSTED when the device is out of memory.
  virtual absl::StatusOr<Buffer> Allocate(int64_t bytes, const Device& device);

  // Synchronous copies between host memory and memory on `device` (of this
  // backend's kind); INTERNAL with the runtime's message on failure. The CPU
  // default is memcpy.
  virtual absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                                    const Device& device);
  virtual absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                                  const Device& device);

  // Opens `byte_size` bytes of device memory exported by another process with
  // an IPC handle (cudaIpcMemHandle_t / hipIpcMemHandle_t, 64 bytes). The
  // default answers FAILED_PRECONDITION: only GPU backends can.
  virtual absl::StatusOr<DeviceMapping> OpenIpcMemory(absl::string_view handle,
                                                      const Device& device,
                                                      uint64_t byte_size);
};

}  // namespace packd

#endif  // PACKD_KERNELS_BACKEND_H_
