// fakegpu: a GPU runtime in host memory with CUDA's semantics where packd
// depends on them, so that the real GPU sources (kernels/gpu/gpu_backend.cc,
// gpu_device_runtime.cc) run and fail here as they would on a device:
//   - asynchronous streams: queued work (copies, kernels) runs later on the
//     stream's own thread, after a delay tests may set;
//   - one last error per host thread, which a failing call records and
//     GetLastError returns and clears; PeekAtLastError returns it only;
//   - sticky errors: a fault (an access outside device memory) or LoseDevice
//     makes every later call on that device fail, and GetLastError never
//     clears it;
//   - device memory with bounds: allocations per device under a memory limit,
//     IPC handles that open whole allocations in another process (the memory
//     is a memfd the importer opens through /proc; the exporter's own open
//     fails as CUDA's does, and a second open of the same memory is the same
//     mapping, counted), and MemGetAddressRange;
//   - the legacy default stream (null): its work waits for the work queued
//     before it on every blocking stream, and theirs for its, as CUDA orders
//     it; non-blocking streams (kStreamNonBlocking) are ordered by nothing;
//   - devices that are physical devices seen under an index of each
//     process's own (CUDA_VISIBLE_DEVICES), with a UUID per physical device;
//   - injected failures (FailNext) and counters (pinned memory, mappings).
// kernels/gpu/gpu_runtime.h maps the gpu* names here when PACKD_GPU_FAKE is
// defined; tests/fake_gpu/fake_gpu_kernels.cc runs the kernels on the host.
//
// clang-format off
//   fakegpu::testing::Configure({.devices = 2, .memory_bytes = 64 << 20});
//   fakegpu::testing::FailNext("Malloc", fakegpu::kErrorMemoryAllocation);
//   fakegpu::testing::SetStreamDelay(absl::Milliseconds(50));
// clang-format on
#ifndef PACKD_TESTS_FAKE_GPU_FAKE_GPU_RUNTIME_H_
#define PACKD_TESTS_FAKE_GPU_FAKE_GPU_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/time/time.h"

namespace fakegpu {

enum Error : int {
  kSuccess = 0,
  kErrorInvalidValue = 1,
  kErrorMemoryAllocation = 2,
  kErrorNoDevice = 100,
  kErrorInvalidDevice = 101,
  kErrorDeviceUninitialized = 201,  // "invalid device context"
  kErrorInvalidResourceHandle = 400,
  kErrorIllegalAddress = 700,
  kErrorLaunchFailure = 719,
};

enum MemcpyKind {
  kMemcpyHostToDevice = 1,
  kMemcpyDeviceToHost = 2,
  kMemcpyDeviceToDevice = 3,
};
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kIpcMemLazyEnablePeerAccess = 1;

struct StreamImpl;
using Stream = StreamImpl*;
struct EventImpl;
using Event = EventImpl*;
struct IpcMemHandle {
  unsigned char reserved[64];
};
struct Uuid {
  char bytes[16];
};
struct DeviceProp {
  size_t totalGlobalMem = 0;
  Uuid uuid{};  // the physical device's, the same in every process
};

Error GetDeviceCount(int* count);
Error SetDevice(int device);
Error GetDevice(int* device);
Error Malloc(void** p, size_t bytes);
Error Free(void* p);
Error MallocHost(void** p, size_t bytes);
Error FreeHost(void* p);
Error MemcpyAsync(void* dst, const void* src, size_t bytes, MemcpyKind kind,
                  Stream stream);
Error MemsetAsync(void* dst, int value, size_t bytes, Stream stream);
Error MemGetInfo(size_t* free, size_t* total);
Error StreamCreateWithFlags(Stream* stream, unsigned flags);
Error StreamDestroy(Stream stream);
Error StreamSynchronize(Stream stream);
// Events: a marker recorded on a stream, complete once the work queued there
// before it has run.
Error EventCreate(Event* event);
Error EventRecord(Event event, Stream stream);
Error EventSynchronize(Event event);
Error EventDestroy(Event event);
// Waits for every stream of the current device.
Error DeviceSynchronize();
Error GetLastError();
Error PeekAtLastError();
const char* GetErrorString(Error error);
Error GetDeviceProperties(DeviceProp* prop, int device);
Error IpcGetMemHandle(IpcMemHandle* handle, void* p);
Error IpcOpenMemHandle(void** p, IpcMemHandle handle, unsigned flags);
Error IpcCloseMemHandle(void* p);
// The allocation holding `p` (device memory or an IPC mapping).
Error MemGetAddressRange(void** base, size_t* size, const void* p);
// The device whose memory `p` is.
Error PointerGetDevice(int* device, const void* p);

// For the fake kernels: queues `work` on `stream` of the current device. The
// work gets an accessor that says whether [p, p + n) is device memory of that
// device; work that returns an error faults the device (a sticky error).
using Accessible = std::function<bool(const void* p, size_t n)>;
Error Launch(Stream stream, std::function<Error(const Accessible&)> work);

// The UUID of physical device `physical`:
// GPU-fa4e0000-0000-0000-0000-0000000000NN.
Uuid PhysicalUuid(int physical);

namespace testing {

struct Config {
  int devices = 1;
  size_t memory_bytes = size_t{1} << 30;  // per device
  // The physical device each index is (default: index i is physical device
  // i), as CUDA_VISIBLE_DEVICES=2,0 makes index 0 physical device 2. Its
  // UUID is PhysicalUuid(physical).
  std::vector<int> physical;
};

// Sets the devices and their memory; call before the first runtime call.
void Configure(Config config);
// Waits until every stream is idle.
void DrainStreams();
// The next call of `function` ("Malloc", "MallocHost", "MemcpyAsync",
// "IpcOpenMemHandle", "Launch", ...) on any thread fails with `error` (not
// sticky).
// `skip` calls of it succeed first.
void FailNext(const char* function, Error error, int skip = 0);
// Every later call on `device` fails with `error`, as after a fault;
// RestoreDevice ends that (as a new process would).
void LoseDevice(int device, Error error);
void RestoreDevice(int device);
// Work queued on a stream runs this long after it is queued.
void SetStreamDelay(absl::Duration delay);
// The largest single pinned allocation so far, and pinned bytes now held.
size_t LargestPinnedAllocation();
size_t PinnedBytesInUse();
// IPC mappings now open.
int OpenIpcMappings();
// An IPC handle for device memory `p` as another process would give it: a
// child process holds the memory (until it is freed) and the handle names
// it, so that a server in this process can open it, as CUDA lets a process
// open only other processes' handles.
Error IpcGetMemHandleFromAnotherProcess(IpcMemHandle* handle, void* p);

}  // namespace testing
}  // namespace fakegpu

#endif  // PACKD_TESTS_FAKE_GPU_FAKE_GPU_RUNTIME_H_
