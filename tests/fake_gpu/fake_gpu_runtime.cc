#include "tests/fake_gpu/fake_gpu_runtime.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace fakegpu {
namespace {

// Device memory is a memfd mapped into this process, so that an IPC open can
// map the same memory again at another address, in this process or another,
// as a real importer does. The memfd is named "fakegpu-<id>", so that an
// importer can tell it from whatever later took its descriptor number.
struct Allocation {
  size_t size = 0;
  int device = 0;     // where the memory is, as this process numbers devices
  int mapped_on = 0;  // whose context this address belongs to
  int fd = -1;        // -1: pinned host memory
  bool ipc_mapping = false;
  uint64_t id = 0;  // of the memory (a mapping has its origin's)
  int opens = 0;    // an IPC mapping: opens not yet closed
};

// What an IPC handle carries: enough for any process to open the memfd.
struct HandleBytes {
  char magic[8];  // "fakegpu"
  int32_t pid;
  int32_t fd;
  uint64_t size;
  int32_t physical;  // the physical device the memory is on
  int32_t unused;
  uint64_t id;
};
static_assert(sizeof(HandleBytes) <= sizeof(IpcMemHandle), "fits a handle");

std::string MemfdName(uint64_t id) { return "fakegpu-" + std::to_string(id); }

struct State {
  absl::Mutex mu;
  testing::Config config;
  std::map<uintptr_t, Allocation> allocations ABSL_GUARDED_BY(mu);
  std::vector<size_t> used ABSL_GUARDED_BY(mu);
  std::vector<int> physical ABSL_GUARDED_BY(mu);  // of each index
  uint64_t next_id ABSL_GUARDED_BY(mu) = std::random_device()();
  std::vector<Error> lost ABSL_GUARDED_BY(mu);
  // Injected failures: the error, and how many calls still pass first.
  std::map<std::string, std::pair<Error, int>> fail_next ABSL_GUARDED_BY(mu);
  absl::Duration delay ABSL_GUARDED_BY(mu);
  size_t largest_pinned ABSL_GUARDED_BY(mu) = 0;
  size_t pinned_in_use ABSL_GUARDED_BY(mu) = 0;
  int ipc_mappings ABSL_GUARDED_BY(mu) = 0;
  std::vector<StreamImpl*> streams ABSL_GUARDED_BY(mu);
  std::map<int, StreamImpl*> default_streams ABSL_GUARDED_BY(mu);
  // testing::IpcGetMemHandleFromAnotherProcess: the process holding each
  // allocation's memory for its handles, by the memory's id.
  std::map<uint64_t, pid_t> exporters ABSL_GUARDED_BY(mu);
};

State& St() {
  static State* state = [] {
    auto* s = new State;
    s->used.assign(s->config.devices, 0);
    s->lost.assign(s->config.devices, kSuccess);
    s->physical.resize(s->config.devices);
    std::iota(s->physical.begin(), s->physical.end(), 0);
    return s;
  }();
  return *state;
}

thread_local int current_device = 0;
thread_local Error last_error = kSuccess;

Error Record(Error e) {
  if (e != kSuccess) last_error = e;
  return e;
}

// Every API call starts here: the device's sticky error, or a failure a test
// injected for `function`.
Error Enter(const char* function, int device) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  if (device >= 0 && device < static_cast<int>(s.lost.size()) &&
      s.lost[device] != kSuccess) {
    return Record(s.lost[device]);
  }
  auto it = s.fail_next.find(function);
  if (it != s.fail_next.end()) {
    if (it->second.second > 0) {
      --it->second.second;
      return kSuccess;
    }
    const Error e = it->second.first;
    s.fail_next.erase(it);
    return Record(e);
  }
  return kSuccess;
}

void Lose(int device, Error error) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  if (device >= 0 && device < static_cast<int>(s.lost.size()) &&
      s.lost[device] == kSuccess) {
    s.lost[device] = error;
  }
}

// Whether [p, p + n) lies in device memory addressable from `device`.
bool AccessibleFrom(int device, const void* p, size_t n) {
  if (n == 0) return true;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocations.upper_bound(a);
  if (it == s.allocations.begin()) return false;
  --it;
  const Allocation& alloc = it->second;
  return alloc.fd >= 0 && alloc.mapped_on == device && a >= it->first &&
         n <= alloc.size && a - it->first <= alloc.size - n;
}

}  // namespace

struct StreamImpl {
  // blocking: created without kStreamNonBlocking, so ordered against the
  // legacy default stream; legacy: the device's default (null) stream.
  StreamImpl(int device, bool blocking, bool legacy)
      : device(device), blocking(blocking), legacy(legacy) {
    worker = std::thread([this] { Run(); });
  }

  // A marker that completes once the work queued here so far has run (one
  // already complete when the stream is idle).
  using Fence = std::shared_ptr<absl::Notification>;

  // Queues `work`, to run after every fence in `after` and (when `delayed`)
  // the delay tests set.
  void Queue(std::function<Error()> work, std::vector<Fence> after = {},
             bool delayed = true) {
    const absl::Duration delay = [delayed] {
      if (!delayed) return absl::ZeroDuration();
      absl::MutexLock lock(&St().mu);
      return St().delay;
    }();
    absl::MutexLock lock(&mu);
    queue.push_back({absl::Now() + delay, std::move(after), std::move(work)});
  }

  Fence MakeFence() {
    auto fence = std::make_shared<absl::Notification>();
    {
      absl::MutexLock lock(&mu);
      if (queue.empty() && !running) {
        fence->Notify();
        return fence;
      }
    }
    Queue(
        [fence] {
          fence->Notify();
          return kSuccess;
        },
        {}, /*delayed=*/false);
    return fence;
  }

  // Waits until everything queued so far has run; the first error of that
  // work, which the wait clears.
  Error Wait() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](StreamImpl* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
          return s->queue.empty() && !s->running;
        },
        this));
    const Error e = error;
    error = kSuccess;
    return e;
  }

  void Run() {
    for (;;) {
      Item item;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](StreamImpl* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
              return !s->queue.empty();
            },
            this));
        item = std::move(queue.front());
        queue.pop_front();
        running = true;
      }
      for (const Fence& f : item.after) f->WaitForNotification();
      absl::SleepFor(item.at - absl::Now());
      const Error e = item.work();
      absl::MutexLock lock(&mu);
      running = false;
      if (e != kSuccess && error == kSuccess) error = e;
    }
  }

  struct Item {
    absl::Time at;
    std::vector<Fence> after;
    std::function<Error()> work;
  };
  const int device;
  const bool blocking;
  const bool legacy;
  absl::Mutex mu;
  std::deque<Item> queue ABSL_GUARDED_BY(mu);
  bool running ABSL_GUARDED_BY(mu) = false;
  Error error ABSL_GUARDED_BY(mu) = kSuccess;
  std::thread worker;  // runs for the life of the process
};

namespace {

// The null stream is the device's legacy default stream.
StreamImpl* Resolve(Stream stream) {
  if (stream != nullptr) return stream;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  StreamImpl*& d = s.default_streams[current_device];
  if (d == nullptr) {
    d = new StreamImpl(current_device, /*blocking=*/true, /*legacy=*/true);
    s.streams.push_back(d);
  }
  return d;
}

// What work queued on `stream` now must wait for, as CUDA orders the legacy
// default stream: work there waits for the work queued before it on every
// blocking stream of the device, and work on a blocking stream for the work
// queued before it on the legacy stream. Non-blocking streams (packd's own,
// NCCL's) wait for nothing and are waited for by nothing.
std::vector<StreamImpl::Fence> OrderedAfter(StreamImpl* stream) {
  std::vector<StreamImpl*> others;
  {
    State& s = St();
    absl::MutexLock lock(&s.mu);
    if (stream->legacy) {
      for (StreamImpl* o : s.streams) {
        if (o != stream && o->device == stream->device && o->blocking) {
          others.push_back(o);
        }
      }
    } else if (stream->blocking) {
      auto it = s.default_streams.find(stream->device);
      if (it != s.default_streams.end()) others.push_back(it->second);
    }
  }
  std::vector<StreamImpl::Fence> fences;
  for (StreamImpl* o : others) fences.push_back(o->MakeFence());
  return fences;
}

// Queues work in CUDA's order for its stream.
void Enqueue(StreamImpl* stream, std::function<Error()> work) {
  stream->Queue(std::move(work), OrderedAfter(stream));
}

// Queues work that faults the device (sticky) when it fails.
void QueueFaulting(StreamImpl* stream, std::function<Error()> work) {
  const int device = stream->device;
  Enqueue(stream, [device, work = std::move(work)]() {
    const Error e = work();
    if (e == kErrorIllegalAddress) Lose(device, e);
    return e;
  });
}

}  // namespace

Error GetDeviceCount(int* count) {
  if (Error e = Enter("GetDeviceCount", -1); e != kSuccess) return e;
  *count = St().config.devices;
  return kSuccess;
}

Error SetDevice(int device) {
  if (device < 0 || device >= St().config.devices) {
    return Record(kErrorInvalidDevice);
  }
  current_device = device;
  return Enter("SetDevice", device);
}

Error GetDevice(int* device) {
  *device = current_device;
  return kSuccess;
}

Error Malloc(void** p, size_t bytes) {
  if (Error e = Enter("Malloc", current_device); e != kSuccess) return e;
  State& s = St();
  {
    absl::MutexLock lock(&s.mu);
    if (s.used[current_device] + bytes > s.config.memory_bytes) {
      return Record(kErrorMemoryAllocation);
    }
    s.used[current_device] += bytes;
  }
  const size_t length = std::max<size_t>(bytes, 1);
  uint64_t id = 0;
  {
    absl::MutexLock lock(&s.mu);
    id = (s.next_id++ << 16) ^ static_cast<uint64_t>(getpid());
  }
  const int fd = memfd_create(MemfdName(id).c_str(), 0);
  void* data =
      fd < 0 || ftruncate(fd, static_cast<off_t>(length)) != 0
          ? MAP_FAILED
          : mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  absl::MutexLock lock(&s.mu);
  if (data == MAP_FAILED) {
    if (fd >= 0) close(fd);
    s.used[current_device] -= bytes;
    return Record(kErrorMemoryAllocation);
  }
  Allocation alloc;
  alloc.size = length;
  alloc.device = alloc.mapped_on = current_device;
  alloc.fd = fd;
  alloc.id = id;
  s.allocations[reinterpret_cast<uintptr_t>(data)] = alloc;
  *p = data;
  return kSuccess;
}

// The device allocation (not pinned host memory, not an IPC mapping) that
// begins at `p`, or null.
Allocation* DeviceAllocationAt(State& s, void* p)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  auto it = s.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocations.end() || it->second.fd < 0 ||
      it->second.ipc_mapping) {
    return nullptr;
  }
  return &it->second;
}

Error Free(void* p) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  const Allocation* a = DeviceAllocationAt(s, p);
  if (a == nullptr) return Record(kErrorInvalidValue);
  munmap(p, a->size);
  close(a->fd);
  s.used[a->device] -= a->size;
  if (auto exporter = s.exporters.find(a->id); exporter != s.exporters.end()) {
    kill(exporter->second, SIGKILL);
    waitpid(exporter->second, nullptr, 0);
    s.exporters.erase(exporter);
  }
  s.allocations.erase(reinterpret_cast<uintptr_t>(p));
  return kSuccess;
}

Error MallocHost(void** p, size_t bytes) {
  if (Error e = Enter("MallocHost", current_device); e != kSuccess) return e;
  void* data =
      std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (data == nullptr) return Record(kErrorMemoryAllocation);
  State& s = St();
  absl::MutexLock lock(&s.mu);
  Allocation alloc;
  alloc.size = bytes;
  alloc.device = alloc.mapped_on = -1;
  s.allocations[reinterpret_cast<uintptr_t>(data)] = alloc;
  s.pinned_in_use += bytes;
  s.largest_pinned = std::max(s.largest_pinned, bytes);
  *p = data;
  return kSuccess;
}

Error FreeHost(void* p) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  auto it = s.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocations.end() || it->second.fd >= 0) {
    return Record(kErrorInvalidValue);
  }
  s.pinned_in_use -= it->second.size;
  s.allocations.erase(it);
  std::free(p);
  return kSuccess;
}

Error MemcpyAsync(void* dst, const void* src, size_t bytes, MemcpyKind kind,
                  Stream stream) {
  if (Error e = Enter("MemcpyAsync", current_device); e != kSuccess) return e;
  StreamImpl* s = Resolve(stream);
  const int device = s->device;
  QueueFaulting(s, [=]() {
    const bool src_ok =
        kind == kMemcpyHostToDevice || AccessibleFrom(device, src, bytes);
    const bool dst_ok =
        kind == kMemcpyDeviceToHost || AccessibleFrom(device, dst, bytes);
    if (!src_ok || !dst_ok) return kErrorIllegalAddress;
    if (bytes > 0) std::memmove(dst, src, bytes);
    return kSuccess;
  });
  return kSuccess;
}

Error MemsetAsync(void* dst, int value, size_t bytes, Stream stream) {
  if (Error e = Enter("MemsetAsync", current_device); e != kSuccess) return e;
  StreamImpl* s = Resolve(stream);
  const int device = s->device;
  QueueFaulting(s, [=]() {
    if (!AccessibleFrom(device, dst, bytes)) return kErrorIllegalAddress;
    if (bytes > 0) std::memset(dst, value, bytes);
    return kSuccess;
  });
  return kSuccess;
}

Error MemGetInfo(size_t* free, size_t* total) {
  if (Error e = Enter("MemGetInfo", current_device); e != kSuccess) return e;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  *total = s.config.memory_bytes;
  *free = s.config.memory_bytes - s.used[current_device];
  return kSuccess;
}

Error StreamCreateWithFlags(Stream* stream, unsigned flags) {
  if (Error e = Enter("StreamCreateWithFlags", current_device); e != kSuccess) {
    return e;
  }
  auto* s = new StreamImpl(current_device,
                           /*blocking=*/(flags & kStreamNonBlocking) == 0,
                           /*legacy=*/false);
  absl::MutexLock lock(&St().mu);
  St().streams.push_back(s);
  *stream = s;
  return kSuccess;
}

Error StreamDestroy(Stream) {
  return kSuccess;  // streams live for the process: tests may drain them
}

Error StreamSynchronize(Stream stream) {
  StreamImpl* s = Resolve(stream);
  // The legacy stream's work includes the blocking streams' before it.
  if (s->legacy) Enqueue(s, [] { return kSuccess; });
  const Error work = s->Wait();
  if (Error e = Enter("StreamSynchronize", s->device); e != kSuccess) {
    return e;
  }
  return Record(work);
}

// An event's state is shared with the work that completes it: the stream's
// worker still unlocks its mutex after the waiter may have woken and
// destroyed the event.
struct EventImpl {
  struct State {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = true;  // never recorded: complete
  };
  std::shared_ptr<State> state = std::make_shared<State>();
};

Error EventCreate(Event* event) {
  if (Error e = Enter("EventCreate", current_device); e != kSuccess) return e;
  *event = new EventImpl;
  return kSuccess;
}

Error EventRecord(Event event, Stream stream) {
  if (Error e = Enter("EventRecord", current_device); e != kSuccess) return e;
  if (event == nullptr) return Record(kErrorInvalidResourceHandle);
  std::shared_ptr<EventImpl::State> state = event->state;
  {
    absl::MutexLock lock(&state->mu);
    state->done = false;
  }
  Enqueue(Resolve(stream), [state] {
    absl::MutexLock lock(&state->mu);
    state->done = true;
    return kSuccess;
  });
  return kSuccess;
}

Error EventSynchronize(Event event) {
  if (event == nullptr) return Record(kErrorInvalidResourceHandle);
  std::shared_ptr<EventImpl::State> state = event->state;
  {
    absl::MutexLock lock(&state->mu);
    state->mu.Await(absl::Condition(&state->done));
  }
  return Enter("EventSynchronize", current_device);
}

Error EventDestroy(Event event) {
  delete event;
  return kSuccess;
}

Error DeviceSynchronize() {
  std::vector<StreamImpl*> streams;
  {
    absl::MutexLock lock(&St().mu);
    for (StreamImpl* s : St().streams) {
      if (s->device == current_device) streams.push_back(s);
    }
  }
  Error first = kSuccess;
  for (StreamImpl* s : streams) {
    const Error e = s->Wait();
    if (first == kSuccess) first = e;
  }
  if (Error e = Enter("DeviceSynchronize", current_device); e != kSuccess) {
    return e;
  }
  return Record(first);
}

Error GetLastError() {
  const Error e = last_error;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  if (s.lost[current_device] != kSuccess) return s.lost[current_device];
  last_error = kSuccess;
  return e;
}

Error PeekAtLastError() { return last_error; }

const char* GetErrorString(Error error) {
  switch (error) {
    case kSuccess:
      return "no error";
    case kErrorInvalidValue:
      return "invalid argument";
    case kErrorMemoryAllocation:
      return "out of memory";
    case kErrorNoDevice:
      return "no CUDA-capable device is detected";
    case kErrorInvalidDevice:
      return "invalid device ordinal";
    case kErrorDeviceUninitialized:
      return "invalid device context";
    case kErrorInvalidResourceHandle:
      return "invalid resource handle";
    case kErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case kErrorLaunchFailure:
      return "unspecified launch failure";
  }
  return "unknown error";
}

Error GetDeviceProperties(DeviceProp* prop, int device) {
  if (device < 0 || device >= St().config.devices) {
    return Record(kErrorInvalidDevice);
  }
  prop->totalGlobalMem = St().config.memory_bytes;
  absl::MutexLock lock(&St().mu);
  prop->uuid = PhysicalUuid(St().physical[device]);
  return kSuccess;
}

Error IpcGetMemHandle(IpcMemHandle* handle, void* p) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  const Allocation* a = DeviceAllocationAt(s, p);
  if (a == nullptr) return Record(kErrorInvalidValue);
  HandleBytes h{};
  std::memcpy(h.magic, "fakegpu", 8);
  h.pid = getpid();
  h.fd = a->fd;
  h.size = a->size;
  h.physical = s.physical[a->device];
  h.id = a->id;
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle->reserved, &h, sizeof(h));
  return kSuccess;
}

Error IpcOpenMemHandle(void** p, IpcMemHandle handle, unsigned) {
  if (Error e = Enter("IpcOpenMemHandle", current_device); e != kSuccess) {
    return e;
  }
  HandleBytes h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (std::memcmp(h.magic, "fakegpu", 8) != 0) {
    return Record(kErrorInvalidResourceHandle);
  }
  // As CUDA: the exporting process cannot open its own handle.
  if (h.pid == getpid()) return Record(kErrorDeviceUninitialized);
  {
    // As CUDA: the same memory opened again in this process is the same
    // mapping, counted; each open needs its close.
    State& s = St();
    absl::MutexLock lock(&s.mu);
    for (auto& [address, a] : s.allocations) {
      if (a.ipc_mapping && a.id == h.id) {
        ++a.opens;
        *p = reinterpret_cast<void*>(address);
        return kSuccess;
      }
    }
  }
  // The exporter's descriptor, if it still is that memory: freed memory, or
  // an exporter that exited, leaves nothing (or something else) there.
  const std::string fd_path =
      "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  char target[256];
  const ssize_t n = readlink(fd_path.c_str(), target, sizeof(target) - 1);
  const std::string expected = "/memfd:" + MemfdName(h.id) + " (deleted)";
  if (n <= 0 || std::string(target, n) != expected) {
    return Record(kErrorInvalidResourceHandle);
  }
  const int fd = open(fd_path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Record(kErrorInvalidResourceHandle);
  State& s = St();
  absl::MutexLock lock(&s.mu);
  int device = -1;
  for (int i = 0; i < static_cast<int>(s.physical.size()); ++i) {
    if (s.physical[i] == h.physical) device = i;
  }
  if (device < 0) {  // the memory's device is not visible here
    close(fd);
    return Record(kErrorInvalidDevice);
  }
  void* mapped =
      mmap(nullptr, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    close(fd);
    return Record(kErrorMemoryAllocation);
  }
  Allocation mapping;
  mapping.size = h.size;
  mapping.device = device;
  mapping.mapped_on = current_device;
  mapping.fd = fd;
  mapping.ipc_mapping = true;
  mapping.id = h.id;
  mapping.opens = 1;
  s.allocations[reinterpret_cast<uintptr_t>(mapped)] = mapping;
  ++s.ipc_mappings;
  *p = mapped;
  return kSuccess;
}

Error IpcCloseMemHandle(void* p) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  auto it = s.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocations.end() || !it->second.ipc_mapping) {
    return Record(kErrorInvalidValue);
  }
  if (--it->second.opens > 0) return kSuccess;
  munmap(p, it->second.size);
  close(it->second.fd);
  s.allocations.erase(it);
  --s.ipc_mappings;
  return kSuccess;
}

Error MemGetAddressRange(void** base, size_t* size, const void* p) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocations.upper_bound(a);
  if (it != s.allocations.begin()) {
    --it;
    if (it->second.fd >= 0 && a - it->first < it->second.size) {
      *base = reinterpret_cast<void*>(it->first);
      *size = it->second.size;
      return kSuccess;
    }
  }
  return Record(kErrorInvalidValue);
}

Error PointerGetDevice(int* device, const void* p) {
  void* base = nullptr;
  size_t size = 0;
  if (Error e = MemGetAddressRange(&base, &size, p); e != kSuccess) return e;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  *device = s.allocations[reinterpret_cast<uintptr_t>(base)].device;
  return kSuccess;
}

Error Launch(Stream stream, std::function<Error(const Accessible&)> work) {
  if (Error e = Enter("Launch", current_device); e != kSuccess) return e;
  StreamImpl* s = Resolve(stream);
  const int device = s->device;
  QueueFaulting(s, [device, work = std::move(work)]() {
    return work([device](const void* p, size_t n) {
      return AccessibleFrom(device, p, n);
    });
  });
  // As the real launchers do after kernel<<<...>>>: the thread's last error,
  // which may be an earlier call's that nobody cleared.
  return GetLastError();
}

namespace testing {

void Configure(Config config) {
  State& s = St();
  absl::MutexLock lock(&s.mu);
  s.config = config;
  s.used.assign(config.devices, 0);
  s.lost.assign(config.devices, kSuccess);
  s.physical = config.physical;
  s.physical.resize(config.devices, -1);
  for (int i = 0; i < config.devices; ++i) {
    if (s.physical[i] < 0) s.physical[i] = i;
  }
}

void DrainStreams() {
  std::vector<StreamImpl*> streams;
  {
    absl::MutexLock lock(&St().mu);
    streams = St().streams;
  }
  for (StreamImpl* s : streams) s->Wait();
}

void FailNext(const char* function, Error error, int skip) {
  absl::MutexLock lock(&St().mu);
  St().fail_next[function] = {error, skip};
}

void LoseDevice(int device, Error error) { Lose(device, error); }

void RestoreDevice(int device) {
  absl::MutexLock lock(&St().mu);
  St().lost[device] = kSuccess;
}

void SetStreamDelay(absl::Duration delay) {
  absl::MutexLock lock(&St().mu);
  St().delay = delay;
}

size_t LargestPinnedAllocation() {
  absl::MutexLock lock(&St().mu);
  return St().largest_pinned;
}

size_t PinnedBytesInUse() {
  absl::MutexLock lock(&St().mu);
  return St().pinned_in_use;
}

int OpenIpcMappings() {
  absl::MutexLock lock(&St().mu);
  return St().ipc_mappings;
}

Error IpcGetMemHandleFromAnotherProcess(IpcMemHandle* handle, void* p) {
  if (Error e = IpcGetMemHandle(handle, p); e != kSuccess) return e;
  HandleBytes h;
  std::memcpy(&h, handle->reserved, sizeof(h));
  // The exporter holds the memory's descriptor as its fd 3, its standard
  // streams on /dev/null (never a pipe of the test's), nothing else, until
  // killed (the memory freed) or until the test's process is gone. Spawned,
  // not forked: a fork would make every page of this process (an in-process
  // server's buffers among them) copy on its next write.
  constexpr int kExporterFd = 3;
  State& s = St();
  absl::MutexLock lock(&s.mu);
  auto found = s.exporters.find(h.id);
  if (found == s.exporters.end()) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    for (int fd = 0; fd < 3; ++fd) {
      posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_RDWR, 0);
    }
    posix_spawn_file_actions_adddup2(&actions, h.fd, kExporterFd);
    posix_spawn_file_actions_addclosefrom_np(&actions, kExporterFd + 1);
    const std::string parent = std::to_string(getpid());
    const std::string script =
        "while kill -0 " + parent + " 2>/dev/null; do sleep 1; done";
    char sh[] = "/bin/sh";
    char dash_c[] = "-c";
    std::vector<char> body(script.begin(), script.end());
    body.push_back('\0');
    char* argv[] = {sh, dash_c, body.data(), nullptr};
    pid_t pid = -1;
    const int spawned = posix_spawn(&pid, sh, &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    if (spawned != 0) return Record(kErrorMemoryAllocation);
    found = s.exporters.emplace(h.id, pid).first;
  }
  h.pid = found->second;
  h.fd = kExporterFd;
  std::memcpy(handle->reserved, &h, sizeof(h));
  return kSuccess;
}

}  // namespace testing

Uuid PhysicalUuid(int physical) {
  Uuid uuid{};
  const unsigned char head[4] = {0xfa, 0x4e, 0x00, 0x00};
  std::memcpy(uuid.bytes, head, sizeof(head));
  uuid.bytes[15] = static_cast<char>(physical);
  return uuid;
}

}  // namespace fakegpu
