// MakeCudaDeviceMemory for a client built without CUDA: GPU tensors are then
// refused by name (client.cc).
#include "client/device_memory.h"

namespace packd {

std::shared_ptr<DeviceMemory> MakeCudaDeviceMemory() { return nullptr; }

}  // namespace packd
