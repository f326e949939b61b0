// The server's device path (a call on cuda:0: host tensors staged to the
// device, results copied back) run without a GPU, against a stand-in backend
// whose "device memory" is host memory. What differs from a real GPU is only
// where the bytes live, so this checks the staging logic itself: every input
// uploaded, every inline result downloaded, and the bytes equal the CPU path's.
#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <memory>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/registry.h"
#include "server/pack_service.h"
#include "tests/e2e/proto_util.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

std::atomic<int64_t> uploaded{0}, downloaded{0};

// cuda:0 whose memory is host memory, counting the bytes staged each way.
class HostMemoryRuntime : public DeviceRuntime {
 public:
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::vector<DeviceInfo> ListDevices() const override {
    return {DeviceInfo{Device{DeviceKind::kCuda, 0}, 0}};
  }
  absl::Status CheckDevice(const Device& device) const override {
    return device.index == 0 ? absl::OkStatus()
                             : absl::FailedPreconditionError("only cuda:0");
  }
  absl::StatusOr<Buffer> Allocate(int64_t bytes, const Device&) override {
    return HostBufferPool::Global().Acquire(bytes);
  }
  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Stream&) override {
    uploaded += bytes;
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Stream&) override {
    downloaded += bytes;
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
};

// The ops on that "device": the CPU implementation.
class HostMemoryGpu : public Backend {
 public:
  HostMemoryGpu() : cpu_(*Registry::Get(Device::Cpu())) {}
  absl::string_view name() const override { return "host-memory-gpu"; }
  absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(
      const TensorView& mask, const Stream& stream) override {
    return cpu_->Plan(mask, stream);
  }
  absl::Status Gather(const MaskPlan& plan, const TensorView& x,
                      const TensorView& out, const Stream& stream) override {
    return cpu_->Gather(plan, x, out, stream);
  }
  absl::Status Scatter(const MaskPlan& plan, const TensorView& packed,
                       const TensorView& dense, const Stream& stream) override {
    return cpu_->Scatter(plan, packed, dense, stream);
  }

 private:
  Backend* cpu_;
};

class GpuPathTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Registry::Global().SetRuntime(std::make_unique<HostMemoryRuntime>());
    ASSERT_TRUE(Registry::Global()
                    .Add(DeviceKind::kCuda, std::make_unique<HostMemoryGpu>(),
                         /*make_default=*/true)
                    .ok());
  }
};

TEST_F(GpuPathTest, PackAndScatterStageThroughTheDeviceAndMatchTheCpuPath) {
  ServiceOptions gpu_options;
  gpu_options.default_device = Device{DeviceKind::kCuda, 0};
  PackServiceImpl gpu(gpu_options);
  PackServiceImpl cpu(ServiceOptions{});
  testing::Rng rng = testing::Rng::Fresh();
  const at::Tensor mask = testing::RandomMask(rng, DType::kFloat32, 5, 97, 0.4,
                                              MaskPattern::kHoles);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kBFloat16, {5, 97, 12});
  const at::Tensor ids = testing::RandomTensor(rng, DType::kInt64, {5, 97});
  v1::PackRequest request;
  *request.mutable_mask() = testing::ToProto(mask);
  *request.add_inputs() = testing::ToProto(x);
  *request.add_inputs() = testing::ToProto(ids);
  request.set_with_position_ids(true);

  uploaded = downloaded = 0;
  v1::PackResponse on_gpu, on_cpu;
  ASSERT_TRUE(gpu.DoPack(request, &on_gpu).ok());
  EXPECT_EQ(uploaded.load(), mask.nbytes() + x.nbytes() + ids.nbytes());
  const at::Tensor expected_x = testing::ReferencePack(x, mask);
  const at::Tensor expected_ids = testing::ReferencePack(ids, mask);
  EXPECT_EQ(downloaded.load(), expected_x.nbytes() + expected_ids.nbytes());
  ASSERT_TRUE(cpu.DoPack(request, &on_cpu).ok());
  EXPECT_EQ(on_gpu.SerializeAsString(), on_cpu.SerializeAsString());
  EXPECT_TRUE(testing::SameTensor(expected_x, on_gpu.packed(0)));
  EXPECT_TRUE(testing::SameTensor(expected_ids, on_gpu.packed(1)));

  // An explicit device in the request takes the same path; a CPU request on the
  // GPU server does not stage.
  v1::ScatterRequest scatter;
  *scatter.mutable_mask() = testing::ToProto(mask);
  *scatter.add_packed() = testing::ToProto(expected_x);
  scatter.set_device("cuda:0");
  uploaded = downloaded = 0;
  v1::ScatterResponse dense;
  ASSERT_TRUE(cpu.DoScatter(scatter, &dense).ok());
  EXPECT_EQ(downloaded.load(), x.nbytes());
  EXPECT_TRUE(testing::SameTensor(
      testing::ReferenceScatter(expected_x, mask, {5, 97, 12}),
      dense.dense(0)));
  scatter.set_device("cpu");
  uploaded = downloaded = 0;
  ASSERT_TRUE(gpu.DoScatter(scatter, &dense).ok());
  EXPECT_EQ(uploaded.load(), 0);

  // Errors on the device path are the same as on the CPU path, found before
  // anything moves.
  request.mutable_inputs(0)->set_shape(1, 96);
  request.mutable_inputs(0)->set_data(std::string(5 * 96 * 12 * 2, '\0'));
  v1::PackResponse bad;
  uploaded = downloaded = 0;
  const absl::Status status = gpu.DoPack(request, &bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(uploaded.load(), 0);
  EXPECT_EQ(downloaded.load(), 0);
  request.set_device("cuda:1");
  EXPECT_EQ(gpu.DoPack(request, &bad).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace packd
