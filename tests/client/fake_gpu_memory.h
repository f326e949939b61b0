// The client's DeviceMemory seam (client/device_memory.h) served by packd's
// fake GPU (tests/fake_gpu) in the test's process: tensors over memfd device
// memory that a packd_testing server run with --fake_gpu_devices opens from
// the IPC handles exported here, as packd opens a CUDA allocation. Fake device
// memory is host memory, so tests read it as CPU tensors; the client tells it
// apart by address.
//
// clang-format off
//   auto gpu = std::make_shared<FakeGpuMemory>();
//   at::Tensor x = gpu->Put(at::randn({4, 16, 8}), 0);  // on fake cuda:0
//   options.device_memory = gpu;
// clang-format on
#ifndef PACKD_TESTS_CLIENT_FAKE_GPU_MEMORY_H_
#define PACKD_TESTS_CLIENT_FAKE_GPU_MEMORY_H_

#include <ATen/ATen.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/tensor_view.h"
#include "client/device_memory.h"
#include "client/stream_order.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"

namespace packd::testing {

// The fake GPU's calls WaitForCallersWork makes (the CUDA runtime's in
// client/cuda_device_memory.cc).
struct FakeGpuRuntime {
  using Event = fakegpu::Event;
  static absl::Status Check(const char* what, fakegpu::Error err) {
    if (err == fakegpu::kSuccess) return absl::OkStatus();
    (void)fakegpu::GetLastError();
    return absl::InternalError(
        absl::StrCat("fake GPU ", what, ": ", fakegpu::GetErrorString(err)));
  }
  absl::Status SynchronizeDevice() {
    return Check("device synchronisation", fakegpu::DeviceSynchronize());
  }
  absl::StatusOr<Event> RecordEvent(void* stream) {
    Event event = nullptr;
    if (absl::Status made = Check("event", fakegpu::EventCreate(&event));
        !made.ok()) {
      return made;
    }
    if (absl::Status recorded = Check(
            "event record",
            fakegpu::EventRecord(event, static_cast<fakegpu::Stream>(stream)));
        !recorded.ok()) {
      fakegpu::EventDestroy(event);
      return recorded;
    }
    return event;
  }
  absl::Status SynchronizeEvent(Event event) {
    return Check("event synchronisation", fakegpu::EventSynchronize(event));
  }
  void DestroyEvent(Event event) { fakegpu::EventDestroy(event); }
};

class FakeGpuMemory : public DeviceMemory,
                      public std::enable_shared_from_this<FakeGpuMemory> {
 public:
  // Tensors on fake device `index` that hold `host`'s bytes.
  at::Tensor Put(const at::Tensor& host, int index) const {
    at::Tensor out = *Empty(host.sizes(), host.scalar_type(), index);
    out.copy_(host);
    return out;
  }
  // Allocations not yet freed.
  int live() const { return live_->load(); }

  std::optional<int> DeviceOf(const at::Tensor& t) const override {
    void* base = nullptr;
    size_t size = 0;
    int device = -1;
    if (t.data_ptr() == nullptr ||
        fakegpu::MemGetAddressRange(&base, &size, t.data_ptr()) !=
            fakegpu::kSuccess ||
        fakegpu::PointerGetDevice(&device, t.data_ptr()) != fakegpu::kSuccess) {
      (void)fakegpu::GetLastError();
      return std::nullopt;
    }
    return device;
  }

  std::string Name(int index) const override {
    return absl::StrCat("cuda:", index);
  }

  absl::StatusOr<std::string> Uuid(int index) const override {
    fakegpu::DeviceProp prop;
    if (fakegpu::GetDeviceProperties(&prop, index) != fakegpu::kSuccess) {
      return absl::InternalError("fake GPU: no such device");
    }
    return FormatDeviceUuid(
        reinterpret_cast<const unsigned char*>(prop.uuid.bytes));
  }

  absl::StatusOr<Allocation> AllocationOf(const at::Tensor& t) const override {
    void* base = nullptr;
    size_t size = 0;
    fakegpu::IpcMemHandle handle;
    if (fakegpu::MemGetAddressRange(&base, &size, t.data_ptr()) !=
            fakegpu::kSuccess ||
        fakegpu::IpcGetMemHandle(&handle, base) != fakegpu::kSuccess) {
      return absl::InternalError("fake GPU: not device memory");
    }
    Allocation out;
    out.base = reinterpret_cast<uintptr_t>(base);
    out.size = size;
    out.ipc_handle.assign(reinterpret_cast<const char*>(handle.reserved), 64);
    return out;
  }

  absl::StatusOr<at::Tensor> Empty(at::IntArrayRef shape, at::ScalarType dtype,
                                   int index) const override {
    int64_t bytes = c10::elementSize(dtype);
    for (int64_t d : shape) bytes *= d;
    void* p = nullptr;
    if (fakegpu::SetDevice(index) != fakegpu::kSuccess ||
        fakegpu::Malloc(&p, std::max<int64_t>(bytes, 1)) != fakegpu::kSuccess) {
      return absl::ResourceExhaustedError("fake GPU allocation failed");
    }
    ++*live_;
    auto watchers = watchers_;
    auto live = live_;
    return at::from_blob(
        p, shape,
        [watchers, live](void* data) {
          std::vector<std::function<void()>> freed;
          {
            absl::MutexLock lock(&watchers->mu);
            auto it = watchers->by_base.find(reinterpret_cast<uintptr_t>(data));
            if (it != watchers->by_base.end()) {
              freed = std::move(it->second);
              watchers->by_base.erase(it);
            }
          }
          fakegpu::Free(data);
          --*live;
          for (auto& f : freed) f();
        },
        at::TensorOptions().dtype(dtype));
  }

  absl::StatusOr<at::Tensor> ToDevice(const at::Tensor& host,
                                      int index) const override {
    return Put(host, index);
  }

  // As the CUDA client's: the caller's current stream when the build can see
  // it (SetCallersStream; null is the legacy default stream), else the
  // device.
  absl::Status Synchronize(int index) const override {
    ++synchronized_;
    if (fakegpu::SetDevice(index) != fakegpu::kSuccess) {
      return FakeGpuRuntime::Check("set device", fakegpu::GetLastError());
    }
    FakeGpuRuntime runtime;
    std::optional<void*> stream;
    {
      absl::MutexLock lock(&callers_mu_);
      if (callers_stream_) stream = static_cast<void*>(*callers_stream_);
    }
    return WaitForCallersWork(runtime, stream);
  }
  // The stream a caller queues its work on, as libtorch's current stream
  // (nullptr: the legacy default stream, libtorch's default); nullopt: a
  // build that cannot see it.
  void SetCallersStream(std::optional<fakegpu::Stream> stream) {
    absl::MutexLock lock(&callers_mu_);
    callers_stream_ = stream;
  }

  void Watch(uintptr_t base, std::function<void()> freed) const override {
    absl::MutexLock lock(&watchers_->mu);
    watchers_->by_base[base].push_back(std::move(freed));
  }

  int synchronized() const { return synchronized_.load(); }

 private:
  struct Watchers {
    absl::Mutex mu;
    std::map<uintptr_t, std::vector<std::function<void()>>> by_base
        ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<Watchers> watchers_ = std::make_shared<Watchers>();
  std::shared_ptr<std::atomic<int>> live_ =
      std::make_shared<std::atomic<int>>(0);
  mutable std::atomic<int> synchronized_{0};
  mutable absl::Mutex callers_mu_;
  std::optional<fakegpu::Stream> callers_stream_ ABSL_GUARDED_BY(callers_mu_);
};

}  // namespace packd::testing

#endif  // PACKD_TESTS_CLIENT_FAKE_GPU_MEMORY_H_
