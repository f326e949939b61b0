// Tensors in the memory of a device (the fake GPU's, in the service's device
// tests): torch tensors copied there and read back.
//
// clang-format off
//   std::vector<Buffer> held;
//   const TensorView x = OnDevice(hidden, kGpu, &held);
//   EXPECT_TRUE(FromDevice(x).equal(hidden));
// clang-format on
#ifndef PACKD_TESTS_SERVICE_DEVICE_TENSORS_H_
#define PACKD_TESTS_SERVICE_DEVICE_TENSORS_H_

#include <ATen/ATen.h>

#include <vector>

#include "base/buffer.h"
#include "base/tensor_view.h"
#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"

namespace packd {
namespace testing {

inline const Device kGpu{DeviceKind::kCuda, 0};

// `t` copied into memory of `device` that `held` keeps; a view of it.
inline TensorView OnDevice(const at::Tensor& t, const Device& device,
                           std::vector<Buffer>* held) {
  TensorView view = AsView(t);
  view.device = device;
  DeviceRuntime* runtime = Registry::Runtime(device).value();
  Buffer buffer =
      runtime->Allocate(std::max<int64_t>(t.nbytes(), 1), device).value();
  Stream stream = runtime->AcquireStream(device).value();
  EXPECT_TRUE(
      runtime->CopyToDevice(buffer.data(), t.data_ptr(), t.nbytes(), stream)
          .ok());
  view.data = buffer.data();
  held->push_back(std::move(buffer));
  return view;
}

// The bytes `bytes` at `data` in `device`'s memory, copied to the host as a
// tensor of `like`'s dtype, shaped `shape`.
inline at::Tensor FromDevice(const void* data, const Device& device,
                             const at::Tensor& like,
                             const std::vector<int64_t>& shape) {
  at::Tensor out = at::empty(shape, like.options());
  DeviceRuntime* runtime = Registry::Runtime(device).value();
  Stream stream = runtime->AcquireStream(device).value();
  EXPECT_TRUE(
      runtime->CopyToHost(out.data_ptr(), data, out.nbytes(), stream).ok());
  return out;
}

}  // namespace testing
}  // namespace packd

#endif  // PACKD_TESTS_SERVICE_DEVICE_TENSORS_H_
