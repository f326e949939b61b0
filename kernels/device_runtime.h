// DeviceRuntime: the facts and the memory of one kind of device (cpu, cuda,
// hip), apart from the ops that run on it: which devices exist, memory for
// results, the stream a call's work runs on, copies to and from host memory,
// and device memory that another process exported. The ops (kernels/backend.h)
// run on what the runtime gives them.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(DeviceRuntime* runtime, Registry::Runtime(device));
//   PACKD_ASSIGN_OR_RETURN(Stream stream, runtime->AcquireStream(device));
//   PACKD_ASSIGN_OR_RETURN(Buffer staged, runtime->Allocate(bytes, device));
//   PACKD_RETURN_IF_ERROR(runtime->CopyToDevice(staged.data(), host, bytes, stream));
// clang-format on
#ifndef PACKD_KERNELS_DEVICE_RUNTIME_H_
#define PACKD_KERNELS_DEVICE_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/buffer.h"
#include "base/tensor_view.h"

namespace packd {

// One device present on this machine. Plain values.
struct DeviceInfo {
  Device device;
  uint64_t memory_bytes = 0;  // total memory; 0 when the runtime cannot say
  // "GPU-8f3c1a2b-...": the same in every process, whatever index each gives
  // the device (CUDA_VISIBLE_DEVICES); empty for the CPU.
  std::string uuid;
};

// Device memory another process exported, opened in this one: `owner` closes
// it when the last holder lets go (its copies may be held by several threads).
struct DeviceMapping {
  void* base = nullptr;
  std::shared_ptr<void> owner;
};

// The queue one call's device work runs on, in order: a cudaStream_t or
// hipStream_t, or nothing on the CPU, where work runs when it is called.
// Move-only; destroying it hands the queue back to its runtime. One call's:
// not shared across threads.
class Stream {
 public:
  using Release = std::function<void(void* handle)>;

  Stream() = default;
  Stream(Device device, void* handle, Release release)
      : device_(device), handle_(handle), release_(std::move(release)) {}
  Stream(Stream&& other) noexcept { *this = std::move(other); }
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  const Device& device() const { return device_; }
  // The runtime's own stream handle; null on the CPU.
  void* handle() const { return handle_; }

  // Keeps `buffer` (memory the stream's queued work reads or writes) until
  // the stream is next synchronised (DeviceRuntime::Synchronize) or goes:
  // stream-ordered lifetime, so that queued work needs no wait of its own.
  void Hold(Buffer buffer) const { held_.push_back(std::move(buffer)); }
  // Lets go of what Hold kept: the stream's work is done.
  void ReleaseHeld() const { held_.clear(); }

 private:
  Device device_;
  void* handle_ = nullptr;
  Release release_;
  mutable std::vector<Buffer> held_;
};

// One piece of a batched copy within a device's memory (DeviceRuntime::
// CopySpans): `bytes` bytes to dst + to from src + from, or, where `from` is
// -1, the pattern repeated from its first byte on. Plain values, 24 bytes.
struct CopySpan {
  int64_t to = 0;
  int64_t from = 0;
  int64_t bytes = 0;
};

// The direction of a queued copy between host and device memory.
enum class CopyDirection { kHostToDevice, kDeviceToHost };

// The memory, streams, copies and IPC of one kind of device. Safe to share
// across threads: one runtime of each kind serves every call of the process.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // The kind of device this runtime drives.
  virtual DeviceKind kind() const = 0;

  // The devices of this kind on this machine, by index; empty when there are
  // none or the runtime cannot be reached (no driver).
  virtual std::vector<DeviceInfo> ListDevices() const = 0;

  // OK when `device` (of this kind) exists on this machine; FAILED_PRECONDITION
  // saying why not (no such index, no driver); UNAVAILABLE once the device is
  // lost (a sticky runtime error: every call on it fails until packd
  // restarts, and the server turns readiness NOT_SERVING for it).
  virtual absl::Status CheckDevice(const Device& device) const = 0;

  // The stream a call on `device` runs its work on; INTERNAL when the runtime
  // cannot make one. The CPU runtime's is empty.
  virtual absl::StatusOr<Stream> AcquireStream(const Device& device);

  // `bytes` of uninitialised memory on `device` (pooled). RESOURCE_EXHAUSTED
  // when the device cannot hold them.
  virtual absl::StatusOr<Buffer> Allocate(int64_t bytes,
                                          const Device& device) = 0;

  // Copies between host memory and memory on the stream's device, complete
  // when they return. INTERNAL with the runtime's message on failure. The CPU
  // runtime's are memcpy.
  virtual absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                                    const Stream& stream) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                                  const Stream& stream) = 0;

  // A row gather within memory of the stream's device: dst row j = src row
  // rows[j] for every j, each row `row_bytes` bytes (dst holds rows.size()
  // rows; src, rows up to its largest index). Runs of consecutive source rows
  // move in one copy. Queued on the stream: complete once Synchronize
  // returns. INTERNAL with the runtime's message on failure. The CPU
  // runtime's is memcpy, complete when it returns.
  virtual absl::Status CopyRows(void* dst, const void* src,
                                absl::Span<const int64_t> rows,
                                int64_t row_bytes, const Stream& stream) = 0;

  // Host memory the device reads and writes in place (pinned), pooled: the
  // host side of CopyAsync. The host runtime's is HostBufferPool's.
  // RESOURCE_EXHAUSTED when none can be had.
  virtual absl::StatusOr<Buffer> AllocateHost(int64_t bytes,
                                              const Device& device);

  // A copy between memory of the stream's device and host memory from
  // AllocateHost, queued on the stream: complete once Synchronize returns,
  // and neither side may be touched before (no host synchronisation here,
  // unlike CopyToDevice and CopyToHost). INTERNAL with the runtime's message
  // when it cannot be queued. The host runtime's is memcpy.
  virtual absl::Status CopyAsync(void* dst, const void* src, int64_t bytes,
                                 CopyDirection direction, const Stream& stream);

  // Every span of `spans` (`count` of them, in memory of the stream's device)
  // copied from `src` into `dst`, pad spans filled from `pattern`
  // (`pattern_bytes` bytes of device memory; unread when no span pads), all
  // within memory of the stream's device, in one kernel. Spans must not
  // overlap in dst. Queued on the stream: complete once Synchronize returns.
  // The host runtime's runs it when called.
  virtual absl::Status CopySpans(void* dst, const void* src,
                                 const CopySpan* spans, int64_t count,
                                 const void* pattern, int64_t pattern_bytes,
                                 const Stream& stream);

  // Returns once all work queued on `stream` has finished; INTERNAL with the
  // runtime's message when some of it failed. Immediate on the CPU.
  virtual absl::Status Synchronize(const Stream& stream);

  // Opens `byte_size` bytes of device memory exported by another process with
  // an IPC handle (cudaIpcMemHandle_t / hipIpcMemHandle_t, 64 bytes).
  // FAILED_PRECONDITION for a runtime that has no IPC memory (the CPU's);
  // INTERNAL with the runtime's message when the handle cannot be opened.
  virtual absl::StatusOr<DeviceMapping> OpenIpcMemory(absl::string_view handle,
                                                      const Device& device,
                                                      uint64_t byte_size);
};

// The runtime of host memory: one device, "cpu", memory from
// HostBufferPool::Global(), copies by memcpy.
std::unique_ptr<DeviceRuntime> MakeHostRuntime();

// The spans that gather rows of `row_bytes` bytes into dst from byte `to` on:
// dst row j = src row rows[j], or the pattern (one row) where rows[j] is -1.
// Consecutive rows of src and runs of pad rows make one span, cut into pieces
// of at most kMaxSpanBytes (a pad span's at whole rows) so that no block of
// the kernel has much more to do than another. Appended to `spans`; nothing
// for rows of 0 bytes.
inline constexpr int64_t kMaxSpanBytes = int64_t{256} << 10;
void AppendRowSpans(absl::Span<const int64_t> rows, int64_t to,
                    int64_t row_bytes, std::vector<CopySpan>* spans);

// What CopySpans does, in host memory: the host runtime's, and the fake
// GPU's kernel.
void RunCopySpans(void* dst, const void* src, const CopySpan* spans,
                  int64_t count, const void* pattern, int64_t pattern_bytes);

// Calls copy(to, from, count) for each run of `rows` whose source rows are
// consecutive (rows[to .. to + count) = from, from + 1, ...), in order: the
// copies a row gather (DeviceRuntime::CopyRows) makes.
void ForEachRowRun(
    absl::Span<const int64_t> rows,
    const std::function<void(int64_t to, int64_t from, int64_t count)>& copy);

}  // namespace packd

#endif  // PACKD_KERNELS_DEVICE_RUNTIME_H_
