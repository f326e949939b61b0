// A fixture for the server's GPU path on the fake GPU (tests/fake_gpu/): three
// fake devices (0: most tests; 1: another device; 2: one a test loses), a
// packd server in this process on a unix socket with handles on, and memory
// on a fake device that the test reads and exports with an IPC handle.
//
//   TEST_F(FakeGpuTest, X) {
//     StartServer();
//     DeviceBuffer in(0, bytes);
//     ASSERT_TRUE(RegisterDevice("in", in, "cuda:0", bytes).ok());
//   }
#ifndef PACKD_TESTS_SERVER_FAKE_GPU_FIXTURE_H_
#define PACKD_TESTS_SERVER_FAKE_GPU_FIXTURE_H_

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kernels/gpu/gpu_backend.h"
#include "kernels/registry.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "server/pack_service.h"
#include "server/server.h"
#include "tests/e2e/region_calls.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"
#include "tests/kernels/test_util.h"

namespace packd {

constexpr size_t kDeviceMemory = size_t{768} << 20;
// Memory on a fake device, readable from the test (fake device memory is
// host memory), exported with an IPC handle as another process's (the server
// runs in this process, and CUDA opens no handle in its exporter).
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(fakegpu::SetDevice(device), fakegpu::kSuccess);
    EXPECT_EQ(fakegpu::Malloc(&data_, bytes), fakegpu::kSuccess);
    std::memset(data_, testing::kCanary, bytes);
  }
  ~DeviceBuffer() { fakegpu::Free(data_); }
  char* data() const { return static_cast<char*>(data_); }
  std::string Handle() const {
    fakegpu::IpcMemHandle handle;
    EXPECT_EQ(
        fakegpu::testing::IpcGetMemHandleFromAnotherProcess(&handle, data_),
        fakegpu::kSuccess);
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }
  void Put(const at::Tensor& t, size_t offset = 0) {
    std::memcpy(data() + offset, t.contiguous().data_ptr(), t.nbytes());
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

class FakeGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fakegpu::testing::Config config;
    config.devices = 3;  // 0: most tests; 1: another device; 2: lost
    config.memory_bytes = kDeviceMemory;
    fakegpu::testing::Configure(config);
    fake_gpu::RegisterGpuBackends(Registry::Global());
  }
  void TearDown() override {
    fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
    fakegpu::testing::DrainStreams();
  }

  // A packd server in this process (handles on), on a unix socket, and a stub
  // for it.
  void StartServer(Device default_device = Device::Cpu()) {
    ServerOptions options;
    options.service.default_device = default_device;
    // A fresh socket for each server: packd refuses a path that the last one
    // may still listen on.
    static int started = 0;
    options.listen = absl::StrCat("unix:/tmp/packd-fake-gpu-", getpid(), "-",
                                  ++started, ".sock");
    options.service.regions.enabled = true;
    options.metrics_listen = metrics_listen_;
    absl::StatusOr<std::unique_ptr<PackdServer>> server =
        PackdServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 30);
    args.SetMaxSendMessageSize(1 << 30);
    channel_ = grpc::CreateCustomChannel(
        server_->address(), grpc::InsecureChannelCredentials(), args);
    stub_ = v1::PackService::NewStub(channel_);
  }
  void StopServer() {
    if (server_ == nullptr) return;
    server_->Drain();
    server_->Wait();
    server_.reset();
  }

  grpc::Status RegisterDevice(const std::string& name,
                              const DeviceBuffer& buffer, const char* device,
                              uint64_t bytes) {
    v1::RegisterDeviceRegionRequest request;
    request.set_name(name);
    request.set_ipc_handle(buffer.Handle());
    request.set_device(device);
    request.set_byte_size(bytes);
    v1::RegisterRegionResponse response;
    grpc::ClientContext context;
    return stub_->RegisterDeviceRegion(&context, request, &response);
  }
  std::string Readiness() {
    auto health = grpc::health::v1::Health::NewStub(channel_);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(kReadinessService);
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    const grpc::Status status = health->Check(&context, request, &response);
    if (!status.ok()) return status.error_message();
    return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
        response.status());
  }
  grpc::Status Unregister(const std::string& name) {
    return testing::UnregisterRegion(*stub_, name);
  }

  // The metrics endpoint StartServer asks for; empty: none.
  std::string metrics_listen_;
  std::unique_ptr<PackdServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::PackService::Stub> stub_;
};

}  // namespace packd

#endif  // PACKD_TESTS_SERVER_FAKE_GPU_FIXTURE_H_
