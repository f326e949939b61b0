// The server's GPU path run without a GPU: the real GPU backend and runtime
// (kernels/gpu/gpu_backend.cc, gpu_device_runtime.cc) built over the fake GPU
// of tests/fake_gpu/, whose streams run work later on their own threads, whose
// errors stick to the thread (or, after a fault, to the device) as CUDA's do,
// and whose device memory is bounded, so that a kernel touching memory outside
// it faults the device instead of passing. Each test pins a way the GPU path
// can go wrong before it ever meets a GPU; all results are checked against
// torch byte for byte.
#include <ATen/ATen.h>

#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/proto_util.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"
#include "tests/kernels/test_util.h"
#include "tests/server/fake_gpu_fixture.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::InRegion;
using testing::Slice;
using testing::ToProto;

// A service whose default device is fake GPU 0.
ServiceOptions OnCuda0() {
  ServiceOptions options;
  options.default_device = Device{DeviceKind::kCuda, 0};
  return options;
}

// A Pack of x under mask through `service`'s core, as plain messages.
absl::Status PackPlain(PackServiceImpl& service, const at::Tensor& x,
                       const at::Tensor& mask, v1::PackResponse* response) {
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  return service.core().DoPack(request, response);
}

// The GPU runtime's pinned staging chunk (gpu_device_runtime.h).
constexpr size_t kStagingChunkBytes = size_t{8} << 20;

TEST_F(FakeGpuTest, HostTensorsStageThroughTheDeviceAndMatchTheCpuPath) {
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
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  *request.add_inputs() = ToProto(ids);
  request.set_with_position_ids(true);

  fakegpu::testing::SetStreamDelay(absl::Milliseconds(5));
  v1::PackResponse on_gpu, on_cpu;
  ASSERT_TRUE(gpu.core().DoPack(request, &on_gpu).ok());
  ASSERT_TRUE(cpu.core().DoPack(request, &on_cpu).ok());
  EXPECT_EQ(on_gpu.SerializeAsString(), on_cpu.SerializeAsString());
  const at::Tensor expected_x = testing::ReferencePack(x, mask);
  EXPECT_TRUE(testing::SameTensor(expected_x, on_gpu.packed(0)));
  EXPECT_TRUE(
      testing::SameTensor(testing::ReferencePack(ids, mask), on_gpu.packed(1)));

  v1::ScatterRequest scatter;
  *scatter.mutable_mask() = ToProto(mask);
  *scatter.add_packed() = ToProto(expected_x);
  scatter.set_device("cuda:0");
  v1::ScatterResponse dense;
  ASSERT_TRUE(cpu.core().DoScatter(scatter, &dense).ok());
  EXPECT_TRUE(testing::SameTensor(
      testing::ReferenceScatter(expected_x, mask, {5, 97, 12}),
      dense.dense(0)));

  // Errors on the device path are the CPU path's.
  request.mutable_inputs(0)->set_shape(1, 96);
  request.mutable_inputs(0)->set_data(std::string(5 * 96 * 12 * 2, '\0'));
  v1::PackResponse bad;
  EXPECT_EQ(gpu.core().DoPack(request, &bad).code(),
            absl::StatusCode::kInvalidArgument);
  request.set_device("cuda:3");
  EXPECT_EQ(gpu.core().DoPack(request, &bad).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Bug: replies went out while the device was still writing the results, and
// an IPC mapping could be closed under a running kernel.
TEST_F(FakeGpuTest, ReplyComesOnlyOnceTheDeviceHasFinished) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const int64_t B = 6, S = 300, H = 40;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.5, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat32, {B, S, H});
  const at::Tensor expected = testing::ReferencePack(x, mask);
  DeviceBuffer in(0, x.nbytes()), out(0, x.nbytes());
  in.Put(x);
  ASSERT_TRUE(RegisterDevice("in", in, "cuda:0", x.nbytes()).ok());
  ASSERT_TRUE(RegisterDevice("out", out, "cuda:0", x.nbytes()).ok());
  const int mappings = fakegpu::testing::OpenIpcMappings();

  fakegpu::testing::SetStreamDelay(absl::Milliseconds(150));
  v1::PackRequest request;
  request.set_device("cuda:0");
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = InRegion(x, "in", 0);
  *request.add_outputs() = Slice("out", 0, x.nbytes());
  v1::PackResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->Pack(&context, request, &response).ok());
  // Read as soon as the reply is here: the rows must be there already.
  EXPECT_TRUE(testing::SameBytesAt(expected, out.data()));
  EXPECT_EQ(response.total_active(), expected.size(0));

  // Unregistering both regions while a Scatter uses them: the call finishes
  // correctly, and only then are the mappings closed.
  v1::ScatterRequest scatter;
  scatter.set_device("cuda:0");
  *scatter.mutable_mask() = ToProto(mask);
  *scatter.add_packed() = InRegion(expected, "out", 0);
  *scatter.add_outputs() = Slice("in", 0, x.nbytes());
  std::future<grpc::Status> call = std::async(std::launch::async, [&] {
    v1::ScatterResponse dense;
    grpc::ClientContext c;
    return stub_->Scatter(&c, scatter, &dense);
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(Unregister("in").ok());
  EXPECT_TRUE(Unregister("out").ok());
  const grpc::Status status = call.get();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(testing::SameBytesAt(
      testing::ReferenceScatter(expected, mask, {B, S, H}), in.data()));
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings - 2);
  StopServer();
}

// A call that fails after it queued device work still waits for that work
// before it returns: no region or staging buffer is let go under a kernel.
TEST_F(FakeGpuTest, AFailedCallWaitsForTheWorkItQueued) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 100, 0.5, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kInt16, {4, 100, 8});
  DeviceBuffer in(0, 2 * x.nbytes()), out(0, 2 * x.nbytes());
  in.Put(x);
  in.Put(x, x.nbytes());
  ASSERT_TRUE(RegisterDevice("in2", in, "cuda:0", 2 * x.nbytes()).ok());
  ASSERT_TRUE(RegisterDevice("out2", out, "cuda:0", 2 * x.nbytes()).ok());
  fakegpu::testing::SetStreamDelay(absl::Milliseconds(150));
  // Launches: the mask scan, the first gather, then the second fails.
  fakegpu::testing::FailNext("Launch", fakegpu::kErrorLaunchFailure, 2);
  v1::PackRequest request;
  request.set_device("cuda:0");
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = InRegion(x, "in2", 0);
  *request.add_inputs() = InRegion(x, "in2", x.nbytes());
  *request.add_outputs() = Slice("out2", 0, x.nbytes());
  *request.add_outputs() = Slice("out2", x.nbytes(), x.nbytes());
  v1::PackResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub_->Pack(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(status.error_message(), HasSubstr("unspecified launch failure"));
  // The first gather, queued before the failure, has finished.
  EXPECT_TRUE(
      testing::SameBytesAt(testing::ReferencePack(x, mask), out.data()));
  StopServer();
}

// Bug: an output slice in device memory was never checked against the call's
// device; a CPU call memcpy'd into GPU memory.
TEST_F(FakeGpuTest, SlicesOnAnotherDeviceThanTheCallAreRefused) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const at::Tensor mask = at::ones({2, 8}, at::kBool);
  const at::Tensor x = testing::RandomTensor(rng, DType::kInt32, {2, 8, 3});
  DeviceBuffer on0(0, 4096), on1(1, 4096);
  ASSERT_TRUE(RegisterDevice("on0", on0, "cuda:0", 4096).ok());
  ASSERT_TRUE(RegisterDevice("on1", on1, "cuda:1", 4096).ok());

  auto pack = [&](const char* device, const char* out_region) {
    v1::PackRequest request;
    request.set_device(device);
    *request.mutable_mask() = ToProto(mask);
    *request.add_inputs() = ToProto(x);
    *request.add_outputs() = Slice(out_region, 0, x.nbytes());
    v1::PackResponse response;
    grpc::ClientContext context;
    return stub_->Pack(&context, request, &response);
  };
  grpc::Status status = pack("cpu", "on0");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("outputs[0] is on cuda:0 but the call runs on cpu"));
  status = pack("cuda:0", "on1");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("outputs[0] is on cuda:1 but the call runs on cuda:0"));
  // An input region on another device, too.
  v1::PackRequest request;
  request.set_device("cuda:0");
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = InRegion(x, "on1", 0);
  v1::PackResponse response;
  grpc::ClientContext context;
  status = stub_->Pack(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("inputs[0] is on cuda:1 but the call runs on cuda:0"));
  // Nothing was written.
  for (const DeviceBuffer* b : {&on0, &on1}) {
    for (int i = 0; i < 4096; ++i) {
      ASSERT_EQ(static_cast<uint8_t>(b->data()[i]), testing::kCanary);
    }
  }
  // The right device works.
  EXPECT_TRUE(pack("cuda:0", "on0").ok());
  EXPECT_TRUE(testing::SameBytesAt(x, on0.data()));
  StopServer();
}

// Bug: a failed runtime call left its error in the thread's runtime state, and
// the next, unrelated call on that thread failed with it.
TEST_F(FakeGpuTest, AnErrorDoesNotStickToTheNextCallOnTheSameThread) {
  PackServiceImpl service(OnCuda0());
  testing::Rng rng = testing::Rng::Fresh();
  // Large enough that the device pool has no block to reuse for it.
  const at::Tensor big = at::zeros({1, 1, 100 << 20}, at::kByte);
  fakegpu::testing::FailNext("Malloc", fakegpu::kErrorMemoryAllocation);
  v1::PackResponse response;
  const absl::Status oom =
      PackPlain(service, big, at::ones({1, 1}, at::kBool), &response);
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted) << oom;
  EXPECT_THAT(std::string(oom.message()), HasSubstr("out of memory"));

  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 3, 40, 0.5, MaskPattern::kPrefix);
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat16, {3, 40, 2});
  v1::PackResponse packed;
  const absl::Status ok = PackPlain(service, x, mask, &packed);
  ASSERT_TRUE(ok.ok()) << ok;
  EXPECT_TRUE(
      testing::SameTensor(testing::ReferencePack(x, mask), packed.packed(0)));
}

// Bug: a lost device (a sticky error) left readiness SERVING while every call
// failed.
TEST_F(FakeGpuTest, ALostDeviceTurnsReadinessNotServingWithTheReason) {
  StartServer(Device{DeviceKind::kCuda, 2});
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(at::ones({2, 3}, at::kBool));
  *request.add_inputs() = ToProto(at::zeros({2, 3, 4}, at::kFloat));
  auto pack = [&] {
    v1::PackResponse response;
    grpc::ClientContext context;
    return stub_->Pack(&context, request, &response);
  };
  ASSERT_TRUE(pack().ok());
  EXPECT_EQ(Readiness(), "SERVING");

  fakegpu::testing::LoseDevice(2, fakegpu::kErrorIllegalAddress);
  grpc::Status status = pack();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(status.error_message(),
              HasSubstr("an illegal memory access was encountered"));
  EXPECT_EQ(Readiness(), "NOT_SERVING");
  status = pack();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("device cuda:2 is lost"));
  StopServer();
  fakegpu::testing::RestoreDevice(2);
}

// Bug: IPC regions were trusted: byte_size as the client said, device
// unchecked.
TEST_F(FakeGpuTest, DeviceRegionsAreCheckedAgainstTheExportedAllocation) {
  StartServer();
  DeviceBuffer buffer(0, 1 << 20);
  const int mappings = fakegpu::testing::OpenIpcMappings();
  grpc::Status status = RegisterDevice("big", buffer, "cuda:0", 2 << 20);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("passes the end of the exported allocation, which "
                        "has 1048576 bytes"));
  status = RegisterDevice("elsewhere", buffer, "cuda:1", 1 << 20);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("memory is on cuda:0 as this server numbers devices, "
                        "not cuda:1"));
  // Refused registrations leave no mapping open.
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings);
  EXPECT_TRUE(RegisterDevice("fits", buffer, "cuda:0", 1 << 20).ok());
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings + 1);
  EXPECT_TRUE(Unregister("fits").ok());
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings);
  StopServer();
}

// Bug: each staged tensor took a pinned buffer as large as itself, and a
// failed pinned allocation said "out of device memory".
TEST_F(FakeGpuTest, StagingUsesBoundedPinnedBuffers) {
  PackServiceImpl service(OnCuda0());
  testing::Rng rng = testing::Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 1000, 0.6, MaskPattern::kHoles);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kFloat32, {4, 1000, 2600});  // 40 MB
  v1::PackResponse response;
  ASSERT_TRUE(PackPlain(service, x, mask, &response).ok());
  EXPECT_TRUE(
      testing::SameTensor(testing::ReferencePack(x, mask), response.packed(0)));
  EXPECT_LE(fakegpu::testing::LargestPinnedAllocation(), kStagingChunkBytes);

  // 3 MiB: no pinned block cached so far fits it, so one is allocated.
  const at::Tensor odd =
      testing::RandomTensor(rng, DType::kUInt8, {3, 7, (3 << 20) / 21});
  fakegpu::testing::FailNext("MallocHost", fakegpu::kErrorMemoryAllocation);
  const absl::Status status =
      PackPlain(service, odd, at::ones({3, 7}, at::kBool), &response);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("pinned host allocation: out of memory"));
}

// The fake refuses what CUDA refuses, so that no test here passes on
// something a GPU would not do: the exporting process cannot open its own
// handle ("invalid device context"), and a handle opened twice in one process
// is one mapping, counted, each open closed in turn.
TEST_F(FakeGpuTest, IpcHandlesOpenAsCudaOpensThem) {
  ASSERT_EQ(fakegpu::SetDevice(0), fakegpu::kSuccess);
  DeviceBuffer buffer(0, 4096);
  fakegpu::IpcMemHandle own;
  ASSERT_EQ(fakegpu::IpcGetMemHandle(&own, buffer.data()), fakegpu::kSuccess);
  void* p = nullptr;
  EXPECT_EQ(
      fakegpu::IpcOpenMemHandle(&p, own, fakegpu::kIpcMemLazyEnablePeerAccess),
      fakegpu::kErrorDeviceUninitialized);
  EXPECT_STREQ(fakegpu::GetErrorString(fakegpu::GetLastError()),
               "invalid device context");

  fakegpu::IpcMemHandle theirs;
  ASSERT_EQ(fakegpu::testing::IpcGetMemHandleFromAnotherProcess(&theirs,
                                                                buffer.data()),
            fakegpu::kSuccess);
  const int mappings = fakegpu::testing::OpenIpcMappings();
  void* first = nullptr;
  void* second = nullptr;
  ASSERT_EQ(fakegpu::IpcOpenMemHandle(&first, theirs, 0), fakegpu::kSuccess);
  ASSERT_EQ(fakegpu::IpcOpenMemHandle(&second, theirs, 0), fakegpu::kSuccess);
  EXPECT_EQ(first, second);
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings + 1);
  std::memset(buffer.data(), 0x5a, 64);  // one memory, seen through the mapping
  EXPECT_EQ(static_cast<unsigned char*>(first)[63], 0x5a);
  ASSERT_EQ(fakegpu::IpcCloseMemHandle(first), fakegpu::kSuccess);
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings + 1);
  ASSERT_EQ(fakegpu::IpcCloseMemHandle(second), fakegpu::kSuccess);
  EXPECT_EQ(fakegpu::testing::OpenIpcMappings(), mappings);
  EXPECT_EQ(fakegpu::IpcCloseMemHandle(second), fakegpu::kErrorInvalidValue);
  (void)fakegpu::GetLastError();
}

// The legacy default stream (null) as CUDA orders it: an event recorded there
// completes after the work queued before it on a blocking stream, and never
// waits for a non-blocking stream's.
TEST_F(FakeGpuTest, TheDefaultStreamWaitsForBlockingStreamsOnly) {
  ASSERT_EQ(fakegpu::SetDevice(0), fakegpu::kSuccess);
  for (const bool blocking : {false, true}) {
    SCOPED_TRACE(blocking ? "blocking" : "non-blocking");
    fakegpu::Stream busy = nullptr;
    ASSERT_EQ(fakegpu::StreamCreateWithFlags(
                  &busy, blocking ? 0 : fakegpu::kStreamNonBlocking),
              fakegpu::kSuccess);
    auto release = std::make_shared<absl::Notification>();
    ASSERT_EQ(fakegpu::Launch(busy,
                              [release](const fakegpu::Accessible&) {
                                release->WaitForNotification();
                                return fakegpu::kSuccess;
                              }),
              fakegpu::kSuccess);
    fakegpu::Event event = nullptr;
    ASSERT_EQ(fakegpu::EventCreate(&event), fakegpu::kSuccess);
    ASSERT_EQ(fakegpu::EventRecord(event, nullptr), fakegpu::kSuccess);
    auto done = std::async(std::launch::async, [event] {
      return fakegpu::EventSynchronize(event);
    });
    // Ordering, not speed: the non-blocking stream's work never completes
    // before `release`, so an event that waited for it could not be done.
    const bool before_release =
        done.wait_for(std::chrono::milliseconds(blocking ? 300 : 20000)) ==
        std::future_status::ready;
    release->Notify();
    EXPECT_EQ(before_release, !blocking);
    EXPECT_EQ(done.get(), fakegpu::kSuccess);
    EXPECT_EQ(fakegpu::StreamSynchronize(busy), fakegpu::kSuccess);
    fakegpu::EventDestroy(event);
  }
}

}  // namespace
}  // namespace packd
