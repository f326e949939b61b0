// The C++ client's GPU path end to end without a GPU: a packd_testing server
// whose cuda is the fake GPU of tests/fake_gpu, and a client whose device
// memory is that fake GPU's in this process (fake_gpu_memory.h). The client
// registers the allocations holding its tensors as device regions, the server
// opens them from their IPC handles (memfd, across the two processes) and
// writes the results into memory the client allocated; every result is
// checked byte for byte against torch.
//
// The processes number the GPUs differently (this process's cuda:0 is the
// server's cuda:1), as CUDA_VISIBLE_DEVICES makes them: devices travel as
// UUIDs.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/autograd.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_gpu_memory.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"
#include "workloads/mask_patterns.h"

namespace packd {
namespace {

using testing::FakeGpuMemory;
using ::testing::HasSubstr;
using testing::ServerProcess;

const std::vector<std::string> kServerFlags = {"--fake_gpu_devices=2",
                                               "--fake_gpu_physical=1,0"};

class ClientFakeGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fakegpu::testing::Config config;
    config.devices = 2;  // index i is physical device i
    config.memory_bytes = size_t{1} << 30;
    fakegpu::testing::Configure(config);
  }

  void SetUp() override {
    server_ =
        ServerProcess::Start(kServerFlags, ServerProcess::Binary::kTesting);
    ASSERT_NE(server_, nullptr);
    client_ = Connect();
  }

  std::unique_ptr<Client> Connect(uint32_t lease_seconds = 30) {
    ClientOptions options;
    options.address = server_->address();
    options.device_memory = gpu_;
    options.lease_seconds = lease_seconds;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // The server's regions: name -> device.
  std::map<std::string, std::string> Regions() {
    v1::ListRegionsResponse listed;
    grpc::ClientContext context;
    EXPECT_TRUE(client_->stub().ListRegions(&context, {}, &listed).ok());
    std::map<std::string, std::string> out;
    for (const v1::RegionInfo& r : listed.regions()) out[r.name()] = r.device();
    return out;
  }

  // A mask of varied active values (2, -1, NaN...), some rows empty.
  at::Tensor RandomMask(int64_t b, int64_t s) {
    return testing::RandomMask(rng_, DType::kFloat32, b, s, 0.6,
                               MaskPattern::kHoles);
  }

  testing::Rng rng_ = testing::Rng::Fresh();

  std::shared_ptr<FakeGpuMemory> gpu_ = std::make_shared<FakeGpuMemory>();
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientFakeGpuTest, PackAndScatterStayInDeviceMemoryForEveryDtype) {
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const at::Tensor x = testing::RandomTensor(rng_, dtype, {5, 33, 3, 2});
    const at::Tensor mask = RandomMask(5, 33);
    PackCallOptions options;
    options.with_position_ids = true;
    const int synced = gpu_->synchronized();
    absl::StatusOr<PackedBatch> batch =
        client_->Pack({gpu_->Put(x, 0)}, gpu_->Put(mask, 0), options);
    ASSERT_TRUE(batch.ok()) << batch.status();
    // The GPU's queued work is done before packd reads the inputs.
    EXPECT_GT(gpu_->synchronized(), synced);
    EXPECT_EQ(gpu_->DeviceOf(batch->packed[0]), 0);
    EXPECT_EQ(gpu_->DeviceOf(batch->cu_seqlens), 0);
    EXPECT_TRUE(
        testing::SameBytes(testing::ReferencePack(x, mask), batch->packed[0]));
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(mask);
    EXPECT_EQ(std::vector<int64_t>(batch->cu_seqlens.data_ptr<int64_t>(),
                                   batch->cu_seqlens.data_ptr<int64_t>() +
                                       batch->cu_seqlens.numel()),
              meta.cu_seqlens);
    EXPECT_EQ(std::vector<int64_t>(batch->position_ids.data_ptr<int64_t>(),
                                   batch->position_ids.data_ptr<int64_t>() +
                                       batch->position_ids.numel()),
              meta.position_ids);
    absl::StatusOr<std::vector<at::Tensor>> dense =
        client_->Scatter({batch->packed[0]}, gpu_->Put(mask, 0));
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_EQ(gpu_->DeviceOf((*dense)[0]), 0);
    EXPECT_TRUE(testing::SameBytes(
        testing::ReferenceScatter(testing::ReferencePack(x, mask), mask,
                                  x.sizes().vec()),
        (*dense)[0]));
  }
}

// GRPO groups packed with their prompt once from device tensors: the stream,
// its targets and metadata on the GPU equal the host path's, and Scatter of
// the targets puts them back on the device.
TEST_F(ClientFakeGpuTest, SharedPromptsOnTheGpuEqualTheHostStream) {
  const int64_t B = 6, S = 24;
  const at::Tensor mask =
      at::arange(S).unsqueeze(0) < at::randint(8, S + 1, {B, 1}, at::kLong);
  at::Tensor tokens = at::randint(0, 100, {B, S}, at::kLong);
  const std::vector<int64_t> groups = {7, 3, 7, 7, 3, 9};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first =
        std::find(groups.begin(), groups.end(), groups[b]) - groups.begin();
    tokens[b].narrow(0, 0, 6).copy_(tokens[first].narrow(0, 0, 6));
  }
  const at::Tensor x = testing::RandomTensor(rng_, DType::kBFloat16, {B, S, 3});
  PackCallOptions options;
  options.with_position_ids = true;
  options.layout.shared_prefix =
      SharedPrefix{groups, std::vector<int64_t>(B, 6), {0}};
  options.layout.shifts = {{0, 0}, {1, 0}};
  absl::StatusOr<PackedBatch> gpu = client_->Pack(
      {gpu_->Put(tokens, 0), gpu_->Put(x, 0)}, gpu_->Put(mask, 0), options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  absl::StatusOr<PackedBatch> host = client_->Pack({tokens, x}, mask, options);
  ASSERT_TRUE(host.ok()) << host.status();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(gpu_->DeviceOf(gpu->packed[i]), 0);
    EXPECT_TRUE(testing::SameBytes(host->packed[i], gpu->packed[i]));
    EXPECT_TRUE(testing::SameBytes(host->shifted[i], gpu->shifted[i]));
  }
  ASSERT_TRUE(gpu->shared.has_value() && host->shared.has_value());
  EXPECT_EQ(gpu_->DeviceOf(gpu->shared->kv_index), 0);
  for (const auto& [g, h] :
       {std::pair{gpu->shared->kv_index, host->shared->kv_index},
        {gpu->shared->pred_index, host->shared->pred_index},
        {gpu->shared->cu_seqlens_k, host->shared->cu_seqlens_k},
        {gpu->shared->segment_row, host->shared->segment_row}}) {
    EXPECT_TRUE(testing::SameBytes(h, g));
  }
  ScatterCallOptions back;
  back.layout.shared_prefix = options.layout.shared_prefix;
  back.layout.shared_prefix->targets = true;
  absl::StatusOr<std::vector<at::Tensor>> dense =
      client_->Scatter({gpu->shifted[1]}, gpu_->Put(mask, 0), back);
  ASSERT_TRUE(dense.ok()) << dense.status();
  absl::StatusOr<std::vector<at::Tensor>> want =
      client_->Scatter({host->shifted[1]}, mask, back);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(gpu_->DeviceOf((*dense)[0]), 0);
  EXPECT_TRUE(testing::SameBytes((*want)[0], (*dense)[0]));
}

TEST_F(ClientFakeGpuTest, DevicesTravelAsUuids) {
  const at::Tensor x = at::randn({2, 8, 4});
  const at::Tensor mask = RandomMask(2, 8);
  ASSERT_TRUE(client_->Pack({gpu_->Put(x, 0)}, gpu_->Put(mask, 0)).ok());
  absl::StatusOr<v1::ServerInfo> info = client_->Info();
  ASSERT_TRUE(info.ok());
  std::map<std::string, std::string> by_uuid;
  for (const v1::DeviceInfo& d : info->devices()) {
    if (d.kind() == "cuda") by_uuid[d.uuid()] = d.name();
  }
  EXPECT_EQ(by_uuid[*gpu_->Uuid(0)], "cuda:1");
  EXPECT_EQ(by_uuid[*gpu_->Uuid(1)], "cuda:0");
  std::set<std::string> devices;
  for (const auto& [name, device] : Regions()) {
    if (name.rfind("cpp-gpu-", 0) == 0) devices.insert(device);
  }
  EXPECT_EQ(devices, std::set<std::string>{"cuda:1"});
  // This process's cuda:1 is the server's cuda:0.
  const at::Tensor y = at::randn({3, 5, 2});
  const at::Tensor m1 = RandomMask(3, 5);
  absl::StatusOr<PackedBatch> other =
      client_->Pack({gpu_->Put(y, 1)}, gpu_->Put(m1, 1));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(
      testing::SameBytes(testing::ReferencePack(y, m1), other->packed[0]));
}

TEST_F(ClientFakeGpuTest, AnUnknownUuidIsFailedPreconditionNamingIt) {
  v1::RegisterDeviceRegionRequest request;
  request.set_name("unknown-uuid");
  request.set_ipc_handle(std::string(64, '\0'));
  request.set_device("cuda:0");
  request.set_byte_size(64);
  request.set_device_uuid("GPU-00000000-0000-0000-0000-000000000bad");
  v1::RegisterRegionResponse response;
  grpc::ClientContext context;
  const grpc::Status status =
      client_->stub().RegisterDeviceRegion(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(),
              HasSubstr("GPU-00000000-0000-0000-0000-000000000bad"));
}

TEST_F(ClientFakeGpuTest, EachAllocationIsRegisteredOnceAndFreedOnesGo) {
  const at::Tensor x = gpu_->Put(at::randn({4, 16, 8}), 0);
  const at::Tensor mask = gpu_->Put(RandomMask(4, 16), 0);
  ASSERT_TRUE(client_->Pack({x}, mask).ok());
  const size_t after_one = Regions().size();
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<PackedBatch> batch = client_->Pack({x}, mask);
    ASSERT_TRUE(batch.ok()) << batch.status();
  }
  // Each call's results are new allocations, freed (and their regions
  // unregistered) after; the inputs' regions stay the first call's.
  EXPECT_LE(Regions().size(), after_one + 1);
}

TEST_F(ClientFakeGpuTest, MemoryAtAFreedAllocationsAddressIsReadAfresh) {
  const at::Tensor mask_host = RandomMask(4, 32);
  const at::Tensor mask = gpu_->Put(mask_host, 0);
  {
    const at::Tensor x = gpu_->Put(at::randn({4, 32, 16}), 0);
    ASSERT_TRUE(client_->Pack({x}, mask).ok());
  }
  const at::Tensor y_host = at::randn({4, 32, 16});
  absl::StatusOr<PackedBatch> batch =
      client_->Pack({gpu_->Put(y_host, 0)}, mask);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(testing::SameBytes(testing::ReferencePack(y_host, mask_host),
                                 batch->packed[0]));
}

TEST_F(ClientFakeGpuTest, DifferentiablePackRunsForwardAndBackwardOnTheGpu) {
  const at::Tensor x_host = at::randn({3, 10, 4}, at::kDouble);
  const at::Tensor mask_host = RandomMask(3, 10);
  at::Tensor x = gpu_->Put(x_host, 0).requires_grad_();
  const at::Tensor mask = gpu_->Put(mask_host, 0);
  absl::StatusOr<at::Tensor> packed = PackWithGrad(*client_, x, mask);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(gpu_->DeviceOf(*packed), 0);
  EXPECT_TRUE(testing::SameBytes(testing::ReferencePack(x_host, mask_host),
                                 packed->detach()));
  const at::Tensor weight = at::randn(packed->sizes(), at::kDouble);
  (*packed * weight).sum().backward();
  EXPECT_TRUE(testing::SameBytes(
      testing::ReferenceScatter(weight, mask_host, x_host.sizes().vec()),
      x.grad()));
}

TEST_F(ClientFakeGpuTest, MixedDevicesAreInvalidArgumentNamingBoth) {
  const at::Tensor x = gpu_->Put(at::randn({2, 4, 3}), 0);
  absl::StatusOr<PackedBatch> host_mask = client_->Pack({x}, RandomMask(2, 4));
  EXPECT_EQ(host_mask.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(host_mask.status().message(),
              HasSubstr("mask is on cpu but inputs[0] is on cuda:0"));
  absl::StatusOr<PackedBatch> other =
      client_->Pack({x}, gpu_->Put(RandomMask(2, 4), 1));
  EXPECT_THAT(other.status().message(),
              HasSubstr("mask is on cuda:1 but inputs[0] is on cuda:0"));
}

TEST_F(ClientFakeGpuTest, ALeaseThatRanOutIsRegisteredAgain) {
  std::unique_ptr<Client> client = Connect(/*lease_seconds=*/1);
  const at::Tensor x_host = at::randn({4, 9, 3});
  const at::Tensor mask_host = RandomMask(4, 9);
  const at::Tensor x = gpu_->Put(x_host, 0), mask = gpu_->Put(mask_host, 0);
  ASSERT_TRUE(client->Pack({x}, mask).ok());
  auto mine = [&] {
    int n = 0;
    for (const auto& [name, device] : Regions())
      n += name.rfind("cpp-gpu-", 0) == 0;
    return n;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (mine() > 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(mine(), 0) << "the leases did not run out";
  absl::StatusOr<PackedBatch> batch = client->Pack({x}, mask);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(testing::SameBytes(testing::ReferencePack(x_host, mask_host),
                                 batch->packed[0]));
  EXPECT_GT(mine(), 0);
}

TEST_F(ClientFakeGpuTest, ARegionUnregisteredWhileACallUsesItServesTheCall) {
  std::unique_ptr<ServerProcess> slow =
      ServerProcess::Start({"--fake_gpu_devices=2", "--fake_gpu_physical=1,0",
                            "--call_delay_ms=1500"},
                           ServerProcess::Binary::kTesting);
  ASSERT_NE(slow, nullptr);
  ClientOptions options;
  options.address = slow->address();
  options.device_memory = gpu_;
  std::unique_ptr<Client> client = *Client::Connect(options);
  const at::Tensor x_host = at::randn({2, 16, 4});
  const at::Tensor mask_host = RandomMask(2, 16);
  const at::Tensor x = gpu_->Put(x_host, 0), mask = gpu_->Put(mask_host, 0);
  ASSERT_TRUE(client->Pack({x}, mask).ok());  // registers x's allocation
  auto call =
      std::async(std::launch::async, [&] { return client->Pack({x}, mask); });
  absl::SleepFor(absl::Milliseconds(500));  // the call holds its regions now
  v1::ListRegionsResponse listed;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(client->stub().ListRegions(&context, {}, &listed).ok());
  }
  ASSERT_GE(listed.regions_size(), 2);  // the mask's, x's and the result's
  for (const v1::RegionInfo& r : listed.regions()) {
    ASSERT_TRUE(client->connection().UnregisterRegion(r.name()).ok());
  }
  absl::StatusOr<PackedBatch> batch = call.get();
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(testing::SameBytes(testing::ReferencePack(x_host, mask_host),
                                 batch->packed[0]));
}

// Threads sharing one client on the GPU path: each packs and scatters its own
// device tensors, and all of them one shared allocation, at once (the
// allocations' regions are registered once between them, and no thread sees
// another's results).
TEST_F(ClientFakeGpuTest, ThreadsSharingOneClientEachGetTheirOwnResults) {
  const at::Tensor shared_host = at::randn({4, 24, 6});
  const at::Tensor shared = gpu_->Put(shared_host, 0);
  const uint64_t seed = rng_.Next();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      testing::Rng rng{std::mt19937_64(seed + t)};
      for (int i = 0; i < 12; ++i) {
        const at::Tensor mask_host = testing::RandomMask(
            rng, DType::kBool, 4, 24, 0.5, MaskPattern::kHoles);
        const at::Tensor x_host =
            i % 3 == 0
                ? shared_host
                : testing::RandomTensor(rng, DType::kBFloat16, {4, 24, 6});
        const at::Tensor x = i % 3 == 0 ? shared : gpu_->Put(x_host, t % 2);
        const at::Tensor mask = gpu_->Put(mask_host, i % 3 == 0 ? 0 : t % 2);
        absl::StatusOr<PackedBatch> r = client_->Pack({x}, mask);
        const at::Tensor want = testing::ReferencePack(x_host, mask_host);
        if (!r.ok() || !testing::SameBytes(want, r->packed[0])) {
          ++failures;
          continue;
        }
        absl::StatusOr<std::vector<at::Tensor>> dense =
            client_->Scatter({r->packed[0]}, mask);
        if (!dense.ok() || !testing::SameBytes(testing::ReferenceScatter(
                                                   want, mask_host, {4, 24, 6}),
                                               (*dense)[0])) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  // The shared allocation ends with one region, however many threads
  // registered it at once (a duplicate goes with the next call: one with a
  // layout, whose results come inline, so that no output of the shared
  // tensor's size is registered beside it).
  PackCallOptions inline_results;
  inline_results.layout.pad_multiple = 1;
  ASSERT_TRUE(
      client_->Pack({shared}, gpu_->Put(RandomMask(4, 24), 0), inline_results)
          .ok());
  v1::ListRegionsResponse listed;
  grpc::ClientContext context;
  ASSERT_TRUE(client_->stub().ListRegions(&context, {}, &listed).ok());
  int regions_of_shared = 0;
  for (const v1::RegionInfo& r : listed.regions()) {
    regions_of_shared +=
        r.byte_size() == static_cast<uint64_t>(shared.nbytes());
  }
  EXPECT_EQ(regions_of_shared, 1);
}

TEST_F(ClientFakeGpuTest, TheClientUnregistersItsDeviceRegionsWhenItGoes) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_TRUE(client
                  ->Pack({gpu_->Put(at::randn({2, 4, 3}), 0)},
                         gpu_->Put(RandomMask(2, 4), 0))
                  .ok());
  client.reset();
  for (const auto& [name, device] : Regions()) {
    EXPECT_NE(name.rfind("cpp-gpu-", 0), 0u) << name;
  }
}

// Every micro-batch of a step, by (rank, index).
using Steps = std::map<std::pair<int, int>, StepMicroBatch>;

absl::StatusOr<Steps> RunStep(Client& client,
                              const std::vector<at::Tensor>& tensors,
                              const at::Tensor& mask,
                              const StepCallOptions& options,
                              v1::PlanResponse* plan) {
  Steps out;
  absl::Status status = client.PackMicroBatches(
      tensors, mask, 80, options,
      [&](const v1::PlanResponse& p) {
        *plan = p;
        return absl::OkStatus();
      },
      [&](StepMicroBatch mb) {
        out[{mb.rank, mb.index}] = std::move(mb);
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return out;
}

// A step with every tensor on the GPU: the host step's plan, and each
// micro-batch's results equal to its, as tensors on the GPU; from the second
// step of a shape on through an arena there (views of it), an earlier step's
// results intact after a later one.
TEST_F(ClientFakeGpuTest, AStepOnTheGpuEqualsTheHostStep) {
  const int64_t B = 10, S = 40;
  at::Tensor mask = at::zeros({B, S}, at::kBool);
  for (int64_t b = 0; b < B; ++b) {
    mask[b]
        .slice(0, 0, 6 + static_cast<int64_t>(rng_.Next() % (S - 5)))
        .fill_(true);
  }
  const at::Tensor tokens = testing::RandomTensor(rng_, DType::kInt64, {B, S});
  const at::Tensor x = testing::RandomTensor(rng_, DType::kBFloat16, {B, S, 3});
  const at::Tensor ids =
      at::div(at::arange(B * S, at::kLong).reshape({B, S}), 7, "floor");
  StepCallOptions options;
  options.plan.num_ranks = 2;
  options.pack.with_position_ids = true;
  options.pack.layout.pad_multiple = 8;
  options.pack.layout.shifts = {{0, -100}};
  options.loss_mask = mask;
  v1::PlanResponse host_plan;
  StepCallOptions host_options = options;
  host_options.pack.segment_ids = ids;
  absl::StatusOr<Steps> host =
      RunStep(*client_, {tokens, x}, mask, host_options, &host_plan);
  ASSERT_TRUE(host.ok()) << host.status();
  // A new client's first step has no arena (its results come inline).
  std::unique_ptr<Client> fresh = Connect();
  StepCallOptions device_options = options;
  device_options.pack.segment_ids = gpu_->Put(ids, 0);
  device_options.loss_mask = gpu_->Put(mask, 0);
  std::vector<Steps> steps;
  for (int k = 0; k < 3; ++k) {
    v1::PlanResponse plan;
    absl::StatusOr<Steps> step =
        RunStep(*fresh, {gpu_->Put(tokens, 0), gpu_->Put(x, 0)},
                gpu_->Put(mask, 0), device_options, &plan);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(plan.SerializeAsString(), host_plan.SerializeAsString());
    ASSERT_EQ(step->size(), host->size());
    for (const auto& [key, mb] : *step) {
      EXPECT_EQ(mb.through_shared_memory, k > 0);
    }
    steps.push_back(std::move(*step));
  }
  for (const Steps& step : steps) {
    for (const auto& [key, mb] : step) {
      const StepMicroBatch& want = host->at(key);
      EXPECT_EQ(mb.samples, want.samples);
      std::vector<at::Tensor> got = mb.batch.packed,
                              expected = want.batch.packed;
      got.insert(got.end(), mb.batch.shifted.begin(), mb.batch.shifted.end());
      expected.insert(expected.end(), want.batch.shifted.begin(),
                      want.batch.shifted.end());
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(gpu_->DeviceOf(got[i]), 0);
        EXPECT_TRUE(testing::SameBytes(expected[i], got[i]));
      }
      EXPECT_EQ(gpu_->DeviceOf(mb.batch.cu_seqlens), 0);
      EXPECT_TRUE(at::equal(mb.batch.cu_seqlens, want.batch.cu_seqlens));
      EXPECT_TRUE(at::equal(mb.batch.position_ids, want.batch.position_ids));
    }
  }
}

// Steps on the GPU from four threads sharing one client, each on its own
// batch: every micro-batch equals that batch's host step (each step's arena is
// its own).
TEST_F(ClientFakeGpuTest, StepsFromThreadsSharingOneClient) {
  constexpr int kThreads = 4;
  std::vector<at::Tensor> tokens, masks;
  std::vector<Steps> expected(kThreads);
  StepCallOptions options;
  options.plan.num_ranks = 2;
  options.pack.layout.shifts = {{0, -100}};
  for (int t = 0; t < kThreads; ++t) {
    masks.push_back(RandomMask(8, 30));
    tokens.push_back(testing::RandomTensor(rng_, DType::kInt64, {8, 30}));
    v1::PlanResponse plan;
    absl::StatusOr<Steps> host =
        RunStep(*client_, {tokens[t]}, masks[t], options, &plan);
    ASSERT_TRUE(host.ok()) << host.status();
    expected[t] = std::move(*host);
  }
  std::vector<std::future<std::string>> runs;
  for (int t = 0; t < kThreads; ++t) {
    runs.push_back(std::async(std::launch::async, [&, t]() -> std::string {
      for (int round = 0; round < 3; ++round) {
        v1::PlanResponse plan;
        absl::StatusOr<Steps> step =
            RunStep(*client_, {gpu_->Put(tokens[t], 0)}, gpu_->Put(masks[t], 0),
                    options, &plan);
        if (!step.ok()) return step.status().ToString();
        if (step->size() != expected[t].size()) return "another plan";
        for (const auto& [key, mb] : *step) {
          const StepMicroBatch& want = expected[t].at(key);
          if (gpu_->DeviceOf(mb.batch.packed[0]) != 0 &&
              mb.batch.packed[0].numel() > 0) {
            return "a result in host memory";
          }
          if (!testing::SameBytes(want.batch.packed[0], mb.batch.packed[0]) ||
              !testing::SameBytes(want.batch.shifted[0], mb.batch.shifted[0])) {
            return absl::StrCat("micro-batch ", key.second, " of rank ",
                                key.first, " differs");
          }
        }
      }
      return "";
    }));
  }
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(runs[t].get(), "") << "thread " << t;
}

// The client waits for its caller's GPU work on the caller's stream only: an
// input written there is read as written, while work that another stream
// (NCCL's, say) still runs does not hold the call up. A build that cannot see
// the caller's stream waits for the whole device.
TEST_F(ClientFakeGpuTest, CallsWaitOnTheCallersStreamNotTheDevice) {
  ASSERT_EQ(fakegpu::SetDevice(0), fakegpu::kSuccess);
  fakegpu::Stream callers = nullptr, other = nullptr;
  ASSERT_EQ(fakegpu::StreamCreateWithFlags(&callers, 0), fakegpu::kSuccess);
  ASSERT_EQ(fakegpu::StreamCreateWithFlags(&other, fakegpu::kStreamNonBlocking),
            fakegpu::kSuccess);
  const at::Tensor host =
      testing::RandomTensor(rng_, DType::kFloat32, {4, 30, 5});
  const at::Tensor mask = RandomMask(4, 30);
  const at::Tensor d_mask = gpu_->Put(mask, 0);
  auto pack_written = [&](absl::Notification* release) {
    // The input is written by the caller's stream, late; the other stream is
    // busy until `release`.
    at::Tensor x = *gpu_->Empty({4, 30, 5}, at::kFloat, 0);
    x.zero_();
    EXPECT_EQ(fakegpu::Launch(other,
                              [release](const fakegpu::Accessible&) {
                                release->WaitForNotification();
                                return fakegpu::kSuccess;
                              }),
              fakegpu::kSuccess);
    fakegpu::testing::SetStreamDelay(absl::Milliseconds(200));
    EXPECT_EQ(fakegpu::MemcpyAsync(x.data_ptr(), host.data_ptr(), host.nbytes(),
                                   fakegpu::kMemcpyHostToDevice, callers),
              fakegpu::kSuccess);
    fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
    return std::async(std::launch::async,
                      [&, x] { return client_->Pack({x}, d_mask); });
  };

  gpu_->SetCallersStream(callers);
  absl::Notification release;
  auto call = pack_written(&release);
  const bool served =
      call.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  release.Notify();
  ASSERT_TRUE(served) << "the call waited for another stream's work";
  absl::StatusOr<PackedBatch> batch = call.get();
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(
      testing::SameBytes(testing::ReferencePack(host, mask), batch->packed[0]));

  gpu_->SetCallersStream(std::nullopt);  // a build that cannot see it
  absl::Notification release_device;
  auto waits = pack_written(&release_device);
  EXPECT_EQ(waits.wait_for(std::chrono::milliseconds(500)),
            std::future_status::timeout);
  release_device.Notify();
  batch = waits.get();
  // The other stream's work is done with the notifications before they go.
  ASSERT_EQ(fakegpu::StreamSynchronize(other), fakegpu::kSuccess);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(
      testing::SameBytes(testing::ReferencePack(host, mask), batch->packed[0]));
}

// The caller's work on the default stream (libtorch's, CUDA's legacy stream:
// a null cudaStream_t) is waited for there, by an event, and not by waiting
// for the device: another stream, non-blocking as NCCL's are, stays busy
// until after the call, and the call does not wait for it. (A client that
// takes a null stream for "no stream known" waits for the device and hangs
// here.)
TEST_F(ClientFakeGpuTest, CallsWaitOnTheDefaultStreamNotTheDevice) {
  ASSERT_EQ(fakegpu::SetDevice(0), fakegpu::kSuccess);
  fakegpu::Stream other = nullptr;
  ASSERT_EQ(fakegpu::StreamCreateWithFlags(&other, fakegpu::kStreamNonBlocking),
            fakegpu::kSuccess);
  const at::Tensor host =
      testing::RandomTensor(rng_, DType::kFloat32, {3, 40, 6});
  const at::Tensor mask = RandomMask(3, 40);
  const at::Tensor d_mask = gpu_->Put(mask, 0);
  at::Tensor x = *gpu_->Empty({3, 40, 6}, at::kFloat, 0);
  x.zero_();
  absl::Notification release;
  ASSERT_EQ(fakegpu::Launch(other,
                            [&release](const fakegpu::Accessible&) {
                              release.WaitForNotification();
                              return fakegpu::kSuccess;
                            }),
            fakegpu::kSuccess);
  // The input, written late by the default stream.
  fakegpu::testing::SetStreamDelay(absl::Milliseconds(200));
  ASSERT_EQ(fakegpu::MemcpyAsync(x.data_ptr(), host.data_ptr(), host.nbytes(),
                                 fakegpu::kMemcpyHostToDevice, nullptr),
            fakegpu::kSuccess);
  fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
  gpu_->SetCallersStream(fakegpu::Stream{nullptr});  // the default stream
  auto call = std::async(std::launch::async,
                         [&] { return client_->Pack({x}, d_mask); });
  const bool served =
      call.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  release.Notify();
  gpu_->SetCallersStream(std::nullopt);
  // The busy stream's work is done with `release` before it goes.
  ASSERT_EQ(fakegpu::StreamSynchronize(other), fakegpu::kSuccess);
  ASSERT_TRUE(served) << "the call waited for the device, not the default "
                         "stream";
  absl::StatusOr<PackedBatch> batch = call.get();
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(
      testing::SameBytes(testing::ReferencePack(host, mask), batch->packed[0]));
}

}  // namespace
}  // namespace packd
