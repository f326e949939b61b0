#include "kernels/device_counters.h"

namespace packd {

const char* DeviceOpName(DeviceOp op) {
  switch (op) {
    case DeviceOp::kKernel:
      return "kernel";
    case DeviceOp::kMemset:
      return "memset";
    case DeviceOp::kCopyHostToDevice:
      return "copy_h2d";
    case DeviceOp::kCopyDeviceToHost:
      return "copy_d2h";
    case DeviceOp::kCopyDeviceToDevice:
      return "copy_d2d";
  }
  return "unknown";
}

int64_t DeviceCounts::total_operations() const {
  int64_t total = 0;
  for (int64_t n : operations) total += n;
  return total;
}

DeviceCounts DeviceCounts::operator-(const DeviceCounts& earlier) const {
  DeviceCounts d = *this;
  d.synchronizations -= earlier.synchronizations;
  for (int i = 0; i < kDeviceOps; ++i) {
    d.operations[i] -= earlier.operations[i];
    d.copy_bytes[i] -= earlier.copy_bytes[i];
  }
  d.pool_acquisitions -= earlier.pool_acquisitions;
  d.pool_misses -= earlier.pool_misses;
  return d;
}

DeviceCounts DeviceCounters::Read() const {
  DeviceCounts c;
  c.synchronizations = synchronizations_.load(kRelaxed);
  for (int i = 0; i < kDeviceOps; ++i) {
    c.operations[i] = operations_[i].load(kRelaxed);
    c.copy_bytes[i] = copy_bytes_[i].load(kRelaxed);
  }
  c.pool_acquisitions = pool_acquisitions_.load(kRelaxed);
  c.pool_misses = pool_misses_.load(kRelaxed);
  return c;
}

}  // namespace packd
