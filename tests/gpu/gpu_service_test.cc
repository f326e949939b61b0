// packd serving on a GPU (--device=cuda:0 or hip:0): inline tensors are staged
// to the device and results copied back, byte for byte equal to torch. Skipped,
// with the reason, without a GPU.
#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "tests/e2e/proto_util.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

const Device kGpu = testing::FirstGpu();

using testing::ToProto;

TEST(GpuService, PackAndScatterOnTheDeviceMatchTorch) {
  const absl::Status available = Registry::Runtime(kGpu).status();
  if (!available.ok())
    GTEST_SKIP() << "no GPU to serve on: " << available.message();
  auto server = testing::ServerProcess::Start({"--device=" + kGpu.ToString()});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  testing::Rng rng = testing::Rng::Fresh();
  for (DType dtype : kAllDTypes) {
    const at::Tensor mask = testing::RandomMask(rng, DType::kFloat32, 6, 333,
                                                0.4, MaskPattern::kHoles);
    const at::Tensor x = testing::RandomTensor(rng, dtype, {6, 333, 5});
    v1::PackRequest request;
    *request.mutable_mask() = ToProto(mask);
    *request.add_inputs() = ToProto(x);
    request.set_with_position_ids(true);
    v1::PackResponse response;
    grpc::ClientContext c1;
    grpc::Status status = stub->Pack(&c1, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const at::Tensor expected = testing::ReferencePack(x, mask);
    ASSERT_EQ(response.packed(0).data().size(),
              static_cast<size_t>(expected.nbytes()));
    EXPECT_EQ(std::memcmp(response.packed(0).data().data(), expected.data_ptr(),
                          expected.nbytes()),
              0)
        << DTypeName(dtype);

    v1::ScatterRequest scatter;
    *scatter.mutable_mask() = ToProto(mask);
    *scatter.add_packed() = ToProto(expected);
    v1::ScatterResponse dense;
    grpc::ClientContext c2;
    status = stub->Scatter(&c2, scatter, &dense);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const at::Tensor expected_dense =
        testing::ReferenceScatter(expected, mask, {6, 333, 5});
    EXPECT_EQ(std::memcmp(dense.dense(0).data().data(),
                          expected_dense.data_ptr(), expected_dense.nbytes()),
              0)
        << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace packd
