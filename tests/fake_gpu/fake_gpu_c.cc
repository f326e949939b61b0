// The fake GPU's device memory behind a C interface, for clients in other
// languages (the Python client's tests reach it with ctypes): a process that
// loads libpackd_fake_gpu_c.so has fake GPUs whose memory a packd_testing
// server run with --fake_gpu_devices opens from the IPC handles it exports.
// Every function returns a fakegpu::Error (0: success).
#include <cstddef>
#include <cstring>
#include <vector>

#include "tests/fake_gpu/fake_gpu_runtime.h"

extern "C" {

// `devices` fake GPUs of `memory_bytes` each, index i being physical device
// physical[i] (n_physical of them; the rest: their index).
int packd_fake_gpu_configure(int devices, const int* physical, int n_physical,
                             size_t memory_bytes) {
  fakegpu::testing::Config config;
  config.devices = devices;
  config.memory_bytes = memory_bytes;
  config.physical.assign(physical, physical + n_physical);
  fakegpu::testing::Configure(config);
  return fakegpu::kSuccess;
}

int packd_fake_gpu_malloc(int device, size_t bytes, void** p) {
  if (fakegpu::Error e = fakegpu::SetDevice(device); e != fakegpu::kSuccess) {
    return e;
  }
  return fakegpu::Malloc(p, bytes);
}

int packd_fake_gpu_free(void* p) { return fakegpu::Free(p); }

// The 64-byte IPC handle of the allocation starting at `p`.
int packd_fake_gpu_ipc_handle(void* p, unsigned char* out) {
  fakegpu::IpcMemHandle handle;
  const fakegpu::Error e = fakegpu::IpcGetMemHandle(&handle, p);
  if (e == fakegpu::kSuccess) std::memcpy(out, handle.reserved, 64);
  return e;
}

// Opens a handle that another process exported, as cudaIpcOpenMemHandle does
// (the exporting process's own handle is refused).
int packd_fake_gpu_ipc_open(const unsigned char* in, void** p) {
  fakegpu::IpcMemHandle handle;
  std::memcpy(handle.reserved, in, 64);
  return fakegpu::IpcOpenMemHandle(p, handle,
                                   fakegpu::kIpcMemLazyEnablePeerAccess);
}

int packd_fake_gpu_ipc_close(void* p) { return fakegpu::IpcCloseMemHandle(p); }

const char* packd_fake_gpu_error_string(int error) {
  return fakegpu::GetErrorString(static_cast<fakegpu::Error>(error));
}

// The allocation holding `p`, and its device; an error for host memory.
int packd_fake_gpu_address_range(const void* p, void** base, size_t* size,
                                 int* device) {
  if (fakegpu::Error e = fakegpu::MemGetAddressRange(base, size, p);
      e != fakegpu::kSuccess) {
    (void)fakegpu::GetLastError();  // host memory is an answer, not a fault
    return e;
  }
  return fakegpu::PointerGetDevice(device, p);
}

// The 16 UUID bytes of device `device`.
int packd_fake_gpu_uuid(int device, unsigned char* out) {
  fakegpu::DeviceProp prop;
  const fakegpu::Error e = fakegpu::GetDeviceProperties(&prop, device);
  if (e == fakegpu::kSuccess) std::memcpy(out, prop.uuid.bytes, 16);
  return e;
}

}  // extern "C"
