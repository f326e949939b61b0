// DeviceCounters: what packd has asked of a kind of device since the process
// started: host synchronisations, stream operations (kernels, memsets, copies
// by direction), bytes copied by direction, and device-pool acquisitions and
// misses. The GPU runtime and its launchers count every call they make to the
// driver (a launcher counts each kernel it queues); the server exports them as
// Prometheus counters (docs/service.md), and a test reads what one call cost
// as the difference of two readings.
//
// clang-format off
//   const DeviceCounts before = DeviceCounters::Of(DeviceKind::kCuda).Read();
//   ... one call ...
//   const DeviceCounts cost = DeviceCounters::Of(DeviceKind::kCuda).Read() - before;
//   EXPECT_LE(cost.synchronizations, 1);
// clang-format on
//
// Standard C++ only: the device sources (gpu_kernels.cu) include it.
#ifndef PACKD_KERNELS_DEVICE_COUNTERS_H_
#define PACKD_KERNELS_DEVICE_COUNTERS_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace packd {

enum class DeviceKind;

// The stream operations counted, by kind.
enum class DeviceOp : int {
  kKernel = 0,
  kMemset,
  kCopyHostToDevice,
  kCopyDeviceToHost,
  kCopyDeviceToDevice,
};
inline constexpr int kDeviceOps = 5;
// Its name in the metrics' `kind` label: "kernel", "memset", "copy_h2d", ...
const char* DeviceOpName(DeviceOp op);

// One reading of a device kind's counters, or the difference of two. Plain
// values.
struct DeviceCounts {
  int64_t synchronizations = 0;
  std::array<int64_t, kDeviceOps> operations{};
  // Bytes copied, indexed like `operations` (the copies' entries only).
  std::array<int64_t, kDeviceOps> copy_bytes{};
  int64_t pool_acquisitions = 0;
  int64_t pool_misses = 0;

  int64_t ops(DeviceOp op) const { return operations[static_cast<int>(op)]; }
  int64_t bytes(DeviceOp op) const { return copy_bytes[static_cast<int>(op)]; }
  // Every stream operation, of any kind.
  int64_t total_operations() const;
  DeviceCounts operator-(const DeviceCounts& earlier) const;
};

// The counters of one device kind. Safe to share across threads: relaxed
// atomics, each counter exact, a reading not a snapshot of all at one instant
// (a test reads them with no other call running).
class DeviceCounters {
 public:
  // Inline, so that the device sources link without the rest of packd (the
  // standalone kernel check, tests/gpu/gpu_check.cu).
  static DeviceCounters& Of(DeviceKind kind) {
    static DeviceCounters counters[3];  // cpu, cuda, hip
    return counters[static_cast<int>(kind)];
  }

  void Synchronized() { synchronizations_.fetch_add(1, kRelaxed); }
  void Operation(DeviceOp op, int64_t bytes = 0) {
    operations_[static_cast<int>(op)].fetch_add(1, kRelaxed);
    if (bytes != 0)
      copy_bytes_[static_cast<int>(op)].fetch_add(bytes, kRelaxed);
  }
  // A block asked of the device pool; a miss: one the pool had to allocate.
  void PoolAcquired() { pool_acquisitions_.fetch_add(1, kRelaxed); }
  void PoolMissed() { pool_misses_.fetch_add(1, kRelaxed); }
  DeviceCounts Read() const;

 private:
  static constexpr std::memory_order kRelaxed = std::memory_order_relaxed;
  std::atomic<int64_t> synchronizations_{0};
  std::array<std::atomic<int64_t>, kDeviceOps> operations_{};
  std::array<std::atomic<int64_t>, kDeviceOps> copy_bytes_{};
  std::atomic<int64_t> pool_acquisitions_{0};
  std::atomic<int64_t> pool_misses_{0};
};

}  // namespace packd

#endif  // PACKD_KERNELS_DEVICE_COUNTERS_H_
