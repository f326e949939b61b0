// Tensor handles end to end: this test process is the client that creates
// shared-memory segments, registers them with the real packd, packs from them
// and into them, and checks every byte against torch; every bounds, overflow,
// key, prefix and name error; unregister while a call is in flight; no
// descriptor or mapping left behind in the server.
#include <ATen/ATen.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/torch_interop.h"
#include "client/shm_mapping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "tests/e2e/proto_util.h"
#include "tests/e2e/region_calls.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::Header;
using testing::InRegion;
using ::testing::Not;
using testing::Rng;
using testing::SameBytesAt;
using testing::ServerProcess;
using testing::Slice;

// Copies `t` into the segment at `offset`.
void Put(const std::unique_ptr<ShmMapping>& seg, uint64_t offset,
         const at::Tensor& t) {
  std::memcpy(seg->data() + offset, t.data_ptr(), t.nbytes());
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Descriptors of `pid` that point at `key`'s shared-memory file.
int OpenDescriptorsTo(pid_t pid, const std::string& key) {
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  int count = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      char target[512];
      const ssize_t n = readlink(absl::StrCat(dir, "/", e->d_name).c_str(),
                                 target, sizeof(target) - 1);
      if (n > 0 &&
          std::string(target, n).find(key.substr(1)) != std::string::npos) {
        ++count;
      }
    }
    closedir(d);
  }
  return count;
}

class RegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = ServerProcess::Start({"--shm_key_prefix=/packd_test"});
    ASSERT_NE(server_, nullptr);
    stub_ = v1::PackService::NewStub(server_->Channel());
  }

  grpc::Status Register(const std::string& name, const std::string& key,
                        uint64_t offset, uint64_t bytes) {
    return testing::RegisterSystemRegion(*stub_, name, key, offset, bytes);
  }
  grpc::Status Unregister(const std::string& name) {
    return testing::UnregisterRegion(*stub_, name);
  }
  grpc::Status CallPack(const v1::PackRequest& r, v1::PackResponse* out) {
    grpc::ClientContext context;
    return stub_->Pack(&context, r, out);
  }
  void ExpectError(const grpc::Status& status, grpc::StatusCode code,
                   const std::string& text) {
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(text));
    // The server keeps serving.
    v1::PackRequest ok;
    const at::Tensor m = at::ones({1, 2}, at::kBool);
    *ok.mutable_mask() = testing::ToProto(m);
    *ok.add_inputs() = testing::ToProto(m);
    v1::PackResponse response;
    EXPECT_TRUE(CallPack(ok, &response).ok());
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::PackService::Stub> stub_;
};

TEST_F(RegionsTest, PackAndScatterFromAndIntoSharedMemory) {
  Rng rng = Rng::Fresh();
  const int64_t B = 8, S = 300, H = 64;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kFloat32, B, S, 0.4, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {B, S, H});
  const at::Tensor ids = testing::RandomTensor(rng, DType::kInt64, {B, S});
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 64 << 20)
          .value();
  const uint64_t x_at = 4096 + 3;  // odd offsets: slices need no alignment
  const uint64_t ids_at = x_at + x.nbytes();
  const uint64_t out_at = 16 << 20, ids_out_at = 32 << 20 | 5;
  Put(seg, x_at, x);
  Put(seg, ids_at, ids);
  std::memset(seg->data() + out_at, 0xA5, 16 << 20);
  // Registered at an offset into the object: slices are relative to it.
  ASSERT_TRUE(Register("w0", seg->key(), 1024, seg->size() - 1024).ok());

  v1::PackRequest request;
  *request.mutable_mask() =
      testing::ToProto(mask);  // inline and region tensors mix
  *request.add_inputs() = InRegion(x, "w0", x_at - 1024);
  *request.add_inputs() = InRegion(ids, "w0", ids_at - 1024);
  *request.add_outputs() = Slice("w0", out_at - 1024, 16 << 20);
  *request.add_outputs() = Slice("w0", ids_out_at - 1024, 1 << 20);
  request.set_with_position_ids(true);
  v1::PackResponse response;
  grpc::Status status = CallPack(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  const at::Tensor expected_x = testing::ReferencePack(x, mask);
  const at::Tensor expected_ids = testing::ReferencePack(ids, mask);
  EXPECT_TRUE(SameBytesAt(expected_x, seg->data() + out_at));
  EXPECT_TRUE(SameBytesAt(expected_ids, seg->data() + ids_out_at));
  // Past the result the canary is intact.
  EXPECT_EQ(static_cast<uint8_t>(seg->data()[out_at + expected_x.nbytes()]),
            0xA5);
  ASSERT_EQ(response.packed_size(), 2);
  EXPECT_TRUE(response.packed(0).data().empty());
  EXPECT_EQ(response.packed(0).region().region(), "w0");
  EXPECT_EQ(response.packed(0).region().offset(), out_at - 1024);
  EXPECT_EQ(response.packed(0).region().byte_size(),
            static_cast<uint64_t>(expected_x.nbytes()));
  EXPECT_EQ(response.packed(0).shape(0), expected_x.size(0));
  EXPECT_EQ(response.total_active(), expected_x.size(0));

  // Scatter the packed rows back, reading and writing the region.
  v1::ScatterRequest scatter;
  *scatter.mutable_mask() = testing::ToProto(mask);
  v1::Tensor packed = Header(expected_x);
  *packed.mutable_region() = response.packed(0).region();
  *scatter.add_packed() = packed;
  *scatter.add_outputs() = Slice("w0", (48 << 20) - 1024, x.nbytes());
  grpc::ClientContext context;
  v1::ScatterResponse dense;
  status = stub_->Scatter(&context, scatter, &dense);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(
      SameBytesAt(testing::ReferenceScatter(expected_x, mask, {B, S, H}),
                  seg->data() + (48 << 20)));

  grpc::ClientContext list_context;
  v1::ListRegionsResponse list;
  ASSERT_TRUE(
      stub_->ListRegions(&list_context, v1::ListRegionsRequest(), &list).ok());
  ASSERT_EQ(list.regions_size(), 1);
  EXPECT_EQ(list.regions(0).name(), "w0");
  EXPECT_EQ(list.regions(0).kind(), "system");
  EXPECT_EQ(list.regions(0).byte_size(), seg->size() - 1024);
  EXPECT_EQ(list.regions(0).device(), "cpu");
}

// A step's results into its outputs (docs/design.md §12): the first message
// says how many bytes they take; given that many, every micro-batch's tensors
// are slices of the outputs in message order, each from a multiple of 64,
// with exactly the bytes of the same step inline; too few, and they come
// inline; outputs over the batch's inputs are INVALID_ARGUMENT.
TEST_F(RegionsTest, AStepsResultsIntoItsOutputs) {
  Rng rng = Rng::Fresh();
  const int64_t B = 24, S = 200;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.6, MaskPattern::kPrefix);
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {B, S, 3});
  const at::Tensor ids = testing::RandomTensor(rng, DType::kInt64, {B, S});
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 16 << 20)
          .value();
  ASSERT_TRUE(Register("w0", seg->key(), 0, seg->size()).ok());
  Put(seg, 0, x);
  v1::PackMicroBatchesRequest request;
  *request.mutable_batch()->mutable_mask() = testing::ToProto(mask);
  *request.mutable_batch()->add_inputs() = InRegion(x, "w0", 0);
  *request.mutable_batch()->add_inputs() = testing::ToProto(ids);
  request.mutable_batch()->set_pad_multiple(8);
  request.mutable_batch()->add_shifts()->set_input(1);
  request.mutable_batch()->set_with_position_ids(true);
  request.mutable_plan()->set_max_tokens_per_micro_batch(800);
  request.mutable_plan()->set_num_ranks(2);
  // Every message of a step, read to the end.
  auto run = [&](const v1::PackMicroBatchesRequest& r) {
    grpc::ClientContext context;
    auto reader = stub_->PackMicroBatches(&context, r);
    std::vector<v1::PackMicroBatchesResponse> messages;
    v1::PackMicroBatchesResponse message;
    while (reader->Read(&message)) messages.push_back(message);
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return messages;
  };
  const std::vector<v1::PackMicroBatchesResponse> inline_step = run(request);
  ASSERT_GT(inline_step.size(), 2u);
  const int64_t output_bytes = inline_step[0].output_bytes();
  int64_t want = 0;
  for (size_t k = 1; k < inline_step.size(); ++k) {
    for (const auto* tensors : {&inline_step[k].packed().packed(),
                                &inline_step[k].packed().shifted()}) {
      for (const v1::Tensor& t : *tensors) {
        want = (want + 63) / 64 * 64 + static_cast<int64_t>(t.data().size());
      }
    }
  }
  EXPECT_EQ(output_bytes, want);

  const uint64_t at = 8 << 20;  // after the batch's x
  std::memset(seg->data() + at, 0xA5, output_bytes + 64);
  request.mutable_outputs()->CopyFrom(Slice("w0", at, output_bytes));
  const std::vector<v1::PackMicroBatchesResponse> into = run(request);
  ASSERT_EQ(into.size(), inline_step.size());
  EXPECT_EQ(into[0].output_bytes(), output_bytes);
  uint64_t next = at;
  for (size_t k = 1; k < into.size(); ++k) {
    EXPECT_EQ(into[k].packed().cu_seqlens_padded_size(),
              inline_step[k].packed().cu_seqlens_padded_size());
    EXPECT_EQ(into[k].packed().position_ids_size(),
              inline_step[k].packed().position_ids_size());
    for (const auto& [got, inline_tensors] :
         {std::pair{&into[k].packed().packed(),
                    &inline_step[k].packed().packed()},
          {&into[k].packed().shifted(), &inline_step[k].packed().shifted()}}) {
      ASSERT_EQ(got->size(), inline_tensors->size());
      for (int i = 0; i < got->size(); ++i) {
        const v1::Tensor& t = got->Get(i);
        const std::string& bytes = inline_tensors->Get(i).data();
        ASSERT_TRUE(t.has_region());
        next = (next + 63) / 64 * 64;
        EXPECT_EQ(t.region().offset(), next);
        EXPECT_EQ(t.region().byte_size(), bytes.size());
        EXPECT_EQ(std::memcmp(seg->data() + t.region().offset(), bytes.data(),
                              bytes.size()),
                  0);
        next += bytes.size();
      }
    }
  }
  EXPECT_EQ(next, at + output_bytes);
  EXPECT_EQ(static_cast<uint8_t>(seg->data()[at + output_bytes]), 0xA5);

  // Too small: inline, as if there were none.
  request.mutable_outputs()->set_byte_size(output_bytes - 1);
  const std::vector<v1::PackMicroBatchesResponse> small = run(request);
  ASSERT_EQ(small.size(), inline_step.size());
  EXPECT_FALSE(small[1].packed().packed(0).has_region());
  EXPECT_EQ(small[1].packed().packed(0).data(),
            inline_step[1].packed().packed(0).data());
  // Over the batch's x: refused by name, nothing sent.
  request.mutable_outputs()->CopyFrom(Slice("w0", 64, output_bytes));
  grpc::ClientContext context;
  auto reader = stub_->PackMicroBatches(&context, request);
  v1::PackMicroBatchesResponse message;
  EXPECT_FALSE(reader->Read(&message));
  ExpectError(reader->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
              "outputs overlaps batch.inputs[0]");
}

TEST_F(RegionsTest, RegistrationErrors) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 20).value();
  const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  ExpectError(Register("", seg->key(), 0, 10), kInvalid,
              "must have 1 to 256 characters");
  ExpectError(Register(std::string(300, 'a'), seg->key(), 0, 10), kInvalid,
              "must have 1 to 256 characters, not 300");
  ExpectError(Register("a b", seg->key(), 0, 10), kInvalid,
              "may hold only letters");
  ExpectError(Register("r", "packd_test_x", 0, 10), kInvalid,
              "is not a shared-memory name");
  ExpectError(Register("r", "/packd_test/x", 0, 10), kInvalid,
              "only letters, digits");
  ExpectError(Register("r", "/..", 0, 10), kInvalid, "\"..\" are not names");
  ExpectError(Register("r", "/other_name", 0, 10), kInvalid,
              "does not start with the server's key prefix \"/packd_test\"");
  ExpectError(Register("r", "/packd_test_absent", 0, 10),
              grpc::StatusCode::NOT_FOUND, "cannot open shared memory");
  ExpectError(Register("r", seg->key(), 0, 0), kInvalid,
              "byte_size must be positive");
  ExpectError(Register("r", seg->key(), 1, 1 << 20), kInvalid,
              "passes the end of");
  ExpectError(Register("r", seg->key(), UINT64_MAX - 5, 10), kInvalid,
              "overflows");
  ASSERT_TRUE(Register("r", seg->key(), 0, 1 << 20).ok());
  ExpectError(Register("r", seg->key(), 0, 10),
              grpc::StatusCode::ALREADY_EXISTS,
              "region \"r\" is already registered");
  ExpectError(Unregister("nope"), grpc::StatusCode::NOT_FOUND,
              "region \"nope\" is not registered");
  EXPECT_TRUE(Unregister("r").ok());
  ExpectError(Unregister("r"), grpc::StatusCode::NOT_FOUND,
              "is not registered");
}

TEST_F(RegionsTest, SliceErrors) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 20).value();
  ASSERT_TRUE(Register("r", seg->key(), 0, 1 << 20).ok());
  const at::Tensor mask = at::ones({2, 4}, at::kBool);
  const at::Tensor x = at::zeros({2, 4, 16}, at::kFloat);  // 512 bytes
  v1::PackRequest good;
  *good.mutable_mask() = testing::ToProto(mask);
  *good.add_inputs() = InRegion(x, "r", 0);
  const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;

  v1::PackRequest r = good;
  r.mutable_inputs(0)->mutable_region()->set_offset((1 << 20) - 100);
  v1::PackResponse response;
  ExpectError(
      CallPack(r, &response), kInvalid,
      "inputs[0].region: slice [1048476, +512) passes the end of region \"r\"");
  r = good;
  r.mutable_inputs(0)->mutable_region()->set_offset(UINT64_MAX - 10);
  ExpectError(CallPack(r, &response), kInvalid, "passes the end of region");
  r = good;
  r.mutable_inputs(0)->mutable_region()->set_byte_size(500);
  ExpectError(CallPack(r, &response), kInvalid,
              "inputs[0].region has 500 bytes but shape [2, 4, 16] of float32 "
              "needs 512");
  r = good;
  *r.add_outputs() = Slice("r", 4096, 100);
  ExpectError(CallPack(r, &response), kInvalid,
              "outputs[0] has 100 bytes but the result needs 512 bytes");
  r = good;
  *r.add_outputs() = Slice("r", 256, 512);
  ExpectError(CallPack(r, &response), kInvalid, "outputs[0] overlaps input 0");
  r = good;
  *r.add_outputs() = Slice("r", 4096, 512);
  *r.add_outputs() = Slice("r", 8192, 512);
  ExpectError(CallPack(r, &response), kInvalid,
              "outputs has 2 slices but there are 1 tensors");
  r = good;
  *r.add_outputs() = Slice("r", (1 << 20) - 10, 512);
  ExpectError(CallPack(r, &response), kInvalid,
              "outputs[0]: slice [1048566, +512) passes the end");
}

TEST(RegionsLifetime, UnregisterDuringACallDefersTheUnmap) {
  auto server = ServerProcess::Start(
      {"--shm_key_prefix=/packd_test", "--call_delay_ms=1000"},
      ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 256, 0.5, MaskPattern::kPrefix);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kFloat16, {4, 256, 32});
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 20).value();
  Put(seg, 0, x);
  const std::string maps = absl::StrCat("/proc/", server->pid(), "/maps");
  {
    v1::RegisterSystemRegionRequest reg;
    reg.set_name("r");
    reg.set_key(seg->key());
    reg.set_byte_size(seg->size());
    grpc::ClientContext context;
    v1::RegisterRegionResponse reg_response;
    ASSERT_TRUE(stub->RegisterSystemRegion(&context, reg, &reg_response).ok());
  }
  EXPECT_THAT(ReadFile(maps), HasSubstr(seg->key()));
  EXPECT_EQ(OpenDescriptorsTo(server->pid(), seg->key()), 0);

  v1::PackRequest request;
  *request.mutable_mask() = testing::ToProto(mask);
  *request.add_inputs() = InRegion(x, "r", 0);
  *request.add_outputs() = Slice("r", 512 << 10, 512 << 10);
  auto in_flight = std::async(std::launch::async, [&] {
    grpc::ClientContext context;
    v1::PackResponse response;
    return stub->Pack(&context, request, &response);
  });
  absl::SleepFor(absl::Milliseconds(400));
  {
    v1::UnregisterRegionRequest unreg;
    unreg.set_name("r");
    grpc::ClientContext context;
    v1::UnregisterRegionResponse unreg_response;
    ASSERT_TRUE(stub->UnregisterRegion(&context, unreg, &unreg_response).ok());
  }
  // Still mapped: the call holds it.
  EXPECT_THAT(ReadFile(maps), HasSubstr(seg->key()));
  const grpc::Status status = in_flight.get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(
      SameBytesAt(testing::ReferencePack(x, mask), seg->data() + (512 << 10)));
  // Gone once the call ended: no mapping, no descriptor.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_THAT(ReadFile(maps), ::testing::Not(HasSubstr(seg->key())));
  EXPECT_EQ(OpenDescriptorsTo(server->pid(), seg->key()), 0);
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

TEST(RegionsDisabled, HandlesAreFailedPreconditionWhenOff) {
  auto server = ServerProcess::Start({"--shared_memory=off"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd"), 4096).value();
  v1::RegisterSystemRegionRequest reg;
  reg.set_name("r");
  reg.set_key(seg->key());
  reg.set_byte_size(4096);
  grpc::ClientContext c1;
  v1::RegisterRegionResponse reg_response;
  grpc::Status status = stub->RegisterSystemRegion(&c1, reg, &reg_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("tensor handles are disabled"));
  grpc::ClientContext c2;
  v1::ListRegionsResponse list;
  EXPECT_EQ(
      stub->ListRegions(&c2, v1::ListRegionsRequest(), &list).error_code(),
      grpc::StatusCode::FAILED_PRECONDITION);
  v1::PackRequest request;
  const at::Tensor m = at::ones({1, 2}, at::kBool);
  *request.mutable_mask() = testing::ToProto(m);
  *request.add_inputs() = InRegion(m, "r", 0);
  grpc::ClientContext c3;
  v1::PackResponse response;
  status = stub->Pack(&c3, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  grpc::ClientContext c4;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&c4, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.shared_memory_enabled());
}

TEST(RegionsDevice, DeviceRegionsNeedAGpuBackend) {
  auto server = ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  v1::RegisterDeviceRegionRequest reg;
  reg.set_name("g");
  reg.set_device("cuda:0");
  reg.set_ipc_handle(std::string(64, '\0'));
  reg.set_byte_size(1 << 20);
  grpc::ClientContext c1;
  v1::RegisterRegionResponse response;
  grpc::Status status = stub->RegisterDeviceRegion(&c1, reg, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << status.error_message();
  reg.set_ipc_handle("short");
  grpc::ClientContext c2;
  status = stub->RegisterDeviceRegion(&c2, reg, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("ipc_handle has 5 bytes"));
}

// Tenants named by their tokens (docs/design.md §15): job B, with its own
// token, cannot list, read, write, scatter into, step from or into,
// unregister or name the key of job A's region; every try is NOT_FOUND
// (PERMISSION_DENIED for the key), in the words of an absent region, and A's
// region and bytes are as they were, byte for byte.
TEST(TenantsTest, AnotherTokensTenantCannotTouchARegion) {
  const std::string tokens = ::testing::TempDir() + "/packd_tenant_tokens";
  {
    std::ofstream f(tokens);
    f << "job-a:token-of-a\njob-b:token-of-b\n";
  }
  std::unique_ptr<ServerProcess> server = ServerProcess::Start(
      {"--shm_key_prefix=/packd_test", "--shared_memory=on",
       "--auth_token_file=" + tokens, "--metrics_listen=127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  const std::string a = "token-of-a", b = "token-of-b";
  auto info = [&](const std::string& token) {
    grpc::ClientContext context;
    testing::WithToken(&context, token);
    v1::ServerInfo response;
    EXPECT_TRUE(stub->GetServerInfo(&context, {}, &response).ok());
    return response.shm_key_prefix();
  };
  ASSERT_EQ(info(a), "/packd_testjob-a.");
  ASSERT_EQ(info(b), "/packd_testjob-b.");

  // A's batch, and room for results, in A's own region.
  Rng rng = Rng::Fresh();
  const int64_t B = 4, S = 32, H = 8;
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat32, {B, S, H});
  const at::Tensor mask = at::ones({B, S}, at::kBool);
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey(info(a)), 1 << 20).value();
  Put(seg, 0, x);
  std::memset(seg->data() + x.nbytes(), 0x5A, seg->size() - x.nbytes());
  ASSERT_TRUE(testing::RegisterSystemRegion(*stub, "A-secret", seg->key(), 0,
                                            seg->size(), a)
                  .ok());
  const std::string before(seg->data(), seg->size());

  // B's view: none of A's regions, and every use of its name is NOT_FOUND
  // as for a region that does not exist.
  grpc::Status listed;
  EXPECT_TRUE(testing::ListRegionNames(*stub, b, &listed).empty());
  EXPECT_TRUE(listed.ok());
  EXPECT_EQ(testing::ListRegionNames(*stub, a),
            std::vector<std::string>{"A-secret"});
  auto pack = [&](const std::string& token, const v1::PackRequest& request) {
    grpc::ClientContext context;
    testing::WithToken(&context, token);
    v1::PackResponse response;
    return stub->Pack(&context, request, &response);
  };
  auto expect_absent = [&](const grpc::Status& status,
                           const std::string& what) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << what;
    EXPECT_THAT(status.error_message(),
                HasSubstr("region \"A-secret\" is not registered"))
        << what;
  };
  v1::PackRequest read;
  *read.mutable_mask() = testing::ToProto(mask);
  *read.add_inputs() = InRegion(x, "A-secret", 0);
  expect_absent(pack(b, read), "B reads A's region");
  v1::PackRequest write;
  *write.mutable_mask() = testing::ToProto(mask);
  *write.add_inputs() = testing::ToProto(x);
  *write.add_outputs() = Slice("A-secret", x.nbytes(), x.nbytes());
  expect_absent(pack(b, write), "B writes A's region");
  {
    v1::ScatterRequest scatter;
    *scatter.mutable_mask() = testing::ToProto(mask);
    *scatter.add_packed() = testing::ToProto(x.reshape({B * S, H}));
    *scatter.add_outputs() = Slice("A-secret", x.nbytes(), x.nbytes());
    grpc::ClientContext context;
    testing::WithToken(&context, b);
    v1::ScatterResponse response;
    expect_absent(stub->Scatter(&context, scatter, &response),
                  "B scatters into A's region");
  }
  for (const bool into : {false, true}) {
    v1::PackMicroBatchesRequest step;
    step.mutable_plan()->set_max_tokens_per_micro_batch(S);
    *step.mutable_batch() = into ? write : read;
    step.mutable_batch()->clear_outputs();
    if (into) *step.mutable_outputs() = Slice("A-secret", 0, seg->size());
    grpc::ClientContext context;
    testing::WithToken(&context, b);
    auto reader = stub->PackMicroBatches(&context, step);
    v1::PackMicroBatchesResponse message;
    while (reader->Read(&message)) {
    }
    expect_absent(reader->Finish(),
                  into ? "B's step writes A's region" : "B's step reads it");
  }
  expect_absent(testing::UnregisterRegion(*stub, "A-secret", b),
                "B unregisters A's region");
  // A's key: inside --shm_key_prefix but not B's prefix.
  const grpc::Status key =
      testing::RegisterSystemRegion(*stub, "mine", seg->key(), 0, 4096, b);
  EXPECT_EQ(key.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(key.error_message(), HasSubstr(seg->key()));
  EXPECT_THAT(key.error_message(), HasSubstr("/packd_testjob-b."));
  // B may use the same name for a region of its own.
  std::unique_ptr<ShmMapping> mine =
      ShmMapping::Create(ShmMapping::UniqueKey(info(b)), 4096).value();
  EXPECT_TRUE(
      testing::RegisterSystemRegion(*stub, "A-secret", mine->key(), 0, 4096, b)
          .ok());

  // A's region and bytes are intact, and A reads its batch as before.
  EXPECT_EQ(std::string(seg->data(), seg->size()), before);
  EXPECT_EQ(testing::ListRegionNames(*stub, a),
            std::vector<std::string>{"A-secret"});
  grpc::ClientContext context;
  testing::WithToken(&context, a);
  v1::PackResponse packed;
  ASSERT_TRUE(stub->Pack(&context, read, &packed).ok());
  EXPECT_TRUE(testing::SameTensor(x.reshape({B * S, H}), packed.packed(0)));

  // The metrics name each tenant's calls, never a token.
  const std::string metrics =
      testing::HttpGet(server->MetricsAddress(), "/metrics");
  EXPECT_THAT(metrics,
              HasSubstr("packd_tenant_calls_total{code=\"not_found\",tenant="
                        "\"job-b\"} 6"));
  EXPECT_THAT(metrics, HasSubstr("tenant=\"job-a\""));
  EXPECT_THAT(metrics, Not(HasSubstr("token-of-")));
}

// A fair share: tenant A floods packd with registrations (one segment named
// by more regions than --max_regions_per_tenant) and with 16 MiB inline calls
// from eight threads, and B's registration and calls are served within their
// deadlines. However many regions name A's segment, packd maps it once.
TEST(TenantsTest, AFloodingTenantLeavesAnotherServed) {
  const std::string tokens = ::testing::TempDir() + "/packd_flood_tokens";
  {
    std::ofstream f(tokens);
    f << "job-a:token-of-a\njob-b:token-of-b\n";
  }
  std::unique_ptr<ServerProcess> server = ServerProcess::Start(
      {"--shm_key_prefix=/packd_test", "--shared_memory=on",
       "--auth_token_file=" + tokens, "--max_regions_per_tenant=300",
       "--max_inflight_bytes=134217728",
       "--max_inflight_bytes_per_tenant=67108864"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  const std::string a = "token-of-a", b = "token-of-b";
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_testjob-a."), 1 << 16)
          .value();
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(testing::RegisterSystemRegion(*stub, absl::StrCat("r", i),
                                              seg->key(), i, 4096, a)
                    .ok())
        << i;
  }
  const grpc::Status full =
      testing::RegisterSystemRegion(*stub, "r300", seg->key(), 0, 4096, a);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("--max_regions_per_tenant=300"));
  std::ifstream maps(absl::StrCat("/proc/", server->pid(), "/maps"));
  int mapped = 0;
  for (std::string line; std::getline(maps, line);) {
    mapped += line.find(seg->key().substr(1)) != std::string::npos;
  }
  EXPECT_EQ(mapped, 1);

  // A's calls, as large as its share allows, from eight threads at once.
  const at::Tensor big = at::zeros({8, 1024, 2048}, at::kByte);  // 16 MiB
  v1::PackRequest flood;
  *flood.mutable_mask() = testing::ToProto(at::ones({8, 1024}, at::kBool));
  *flood.add_inputs() = testing::ToProto(big);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        grpc::ClientContext context;
        testing::WithToken(&context, a);
        context.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::seconds(20));
        v1::PackResponse response;
        (void)stub->Pack(&context, flood, &response);
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));  // the flood is under way
  v1::PackRequest small;
  *small.mutable_mask() = testing::ToProto(at::ones({2, 8}, at::kBool));
  *small.add_inputs() = testing::ToProto(at::ones({2, 8, 4}, at::kFloat));
  for (int i = 0; i < 10; ++i) {
    grpc::ClientContext context;
    testing::WithToken(&context, b);
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    v1::PackResponse response;
    const grpc::Status status = stub->Pack(&context, small, &response);
    EXPECT_TRUE(status.ok()) << i << ": " << status.error_message();
  }
  EXPECT_TRUE(
      testing::RegisterSystemRegion(
          *stub, "b0",
          ShmMapping::Create(ShmMapping::UniqueKey("/packd_testjob-b."), 4096)
              .value()
              ->key(),
          0, 4096, b)
          .ok());
  stop = true;
  for (std::thread& t : threads) t.join();
}

}  // namespace
}  // namespace packd
