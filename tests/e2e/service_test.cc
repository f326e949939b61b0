// End to end: the real packd binary on a loopback port, called through the
// generated C++ stub. Results are compared byte for byte with libtorch; every
// error path is checked for its code and message, and the server must keep
// serving after each.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "planner/planner.h"
#include "planner/testing/check_plan.h"
#include "proto/plan_codec.h"
#include "tests/e2e/proto_util.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::HttpGet;
using testing::Rng;
using testing::SameTensor;
using testing::ServerProcess;
using testing::ToProto;

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = ServerProcess::Start().release();
    ASSERT_NE(server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = v1::PackService::NewStub(server_->Channel());
  }

  grpc::Status CallPack(const v1::PackRequest& request,
                        v1::PackResponse* response) {
    grpc::ClientContext context;
    return stub_->Pack(&context, request, response);
  }
  grpc::Status CallScatter(const v1::ScatterRequest& request,
                           v1::ScatterResponse* response) {
    grpc::ClientContext context;
    return stub_->Scatter(&context, request, response);
  }

  // A small valid request; after every error the server must still answer it.
  void ExpectStillServing() {
    v1::PackRequest request;
    *request.mutable_mask() = ToProto(at::ones({2, 3}, at::kByte));
    *request.add_inputs() = ToProto(at::arange(6, at::kInt).view({2, 3}));
    v1::PackResponse response;
    grpc::Status status = CallPack(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.total_active(), 6);
  }

  void ExpectPackError(const v1::PackRequest& request, grpc::StatusCode code,
                       const std::string& text) {
    v1::PackResponse response;
    grpc::Status status = CallPack(request, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(text));
    ExpectStillServing();
  }

  void ExpectScatterError(const v1::ScatterRequest& request,
                          grpc::StatusCode code, const std::string& text) {
    v1::ScatterResponse response;
    grpc::Status status = CallScatter(request, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(text));
    ExpectStillServing();
  }

  static ServerProcess* server_;
  std::unique_ptr<v1::PackService::Stub> stub_;
};

ServerProcess* ServiceTest::server_ = nullptr;

TEST_F(ServiceTest, PackSeveralTensorsPerCallEveryDtypeEveryMaskDtype) {
  Rng rng = Rng::Fresh();
  for (int m = 0; m < 10; ++m) {
    const DType mask_dtype = kAllDTypes[m];
    const int64_t B = 1 + rng.Next() % 6, S = 1 + rng.Next() % 200;
    const at::Tensor mask =
        testing::RandomMask(rng, mask_dtype, B, S, rng.Uniform(),
                            m % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix);
    v1::PackRequest request;
    *request.mutable_mask() = ToProto(mask);
    request.set_with_position_ids(true);
    std::vector<at::Tensor> inputs;
    for (int i = 0; i < 10; ++i) {
      const std::vector<int64_t> shape =
          i % 3 == 0 ? std::vector<int64_t>{B, S}
                     : std::vector<int64_t>{B, S, 1 + int64_t(rng.Next() % 5)};
      inputs.push_back(
          testing::RandomTensor(rng, kAllDTypes[(i + m) % 10], shape));
      *request.add_inputs() = ToProto(inputs.back());
    }
    v1::PackResponse response;
    grpc::Status status = CallPack(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.packed_size(), 10);
    for (int i = 0; i < 10; ++i) {
      EXPECT_TRUE(SameTensor(testing::ReferencePack(inputs[i], mask),
                             response.packed(i)))
          << "inputs[" << i << "] with a " << DTypeName(mask_dtype) << " mask";
    }
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(mask);
    EXPECT_EQ(std::vector<int64_t>(response.cu_seqlens().begin(),
                                   response.cu_seqlens().end()),
              meta.cu_seqlens);
    EXPECT_EQ(response.total_active(), meta.total_active);
    EXPECT_EQ(response.max_seqlen(), meta.max_seqlen);
    EXPECT_EQ(std::vector<int64_t>(response.position_ids().begin(),
                                   response.position_ids().end()),
              meta.position_ids);
    EXPECT_EQ(std::vector<int64_t>(response.last_index().begin(),
                                   response.last_index().end()),
              meta.last_index);
  }
}

TEST_F(ServiceTest, ScatterSeveralTensorsPerCallEveryDtypeEveryMaskDtype) {
  Rng rng = Rng::Fresh();
  for (int m = 0; m < 10; ++m) {
    const int64_t B = 1 + rng.Next() % 6, S = 1 + rng.Next() % 200;
    const at::Tensor mask =
        testing::RandomMask(rng, kAllDTypes[m], B, S, rng.Uniform(),
                            m % 2 ? MaskPattern::kPrefix : MaskPattern::kHoles);
    const int64_t total = mask.ne(0).sum().item<int64_t>();
    v1::ScatterRequest request;
    *request.mutable_mask() = ToProto(mask);
    request.mutable_tail_shape()->add_dims(3);
    std::vector<at::Tensor> packed;
    for (int i = 0; i < 10; ++i) {
      packed.push_back(
          testing::RandomTensor(rng, kAllDTypes[(i + m) % 10], {total, 3}));
      *request.add_packed() = ToProto(packed.back());
    }
    v1::ScatterResponse response;
    grpc::Status status = CallScatter(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.dense_size(), 10);
    for (int i = 0; i < 10; ++i) {
      EXPECT_TRUE(
          SameTensor(testing::ReferenceScatter(packed[i], mask, {B, S, 3}),
                     response.dense(i)))
          << "packed[" << i << "]";
    }
  }
}

TEST_F(ServiceTest, ThirtyTwoMebibyteRequestOverGrpcsDefaultLimit) {
  Rng rng = Rng::Fresh();
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kFloat32, {8, 1024, 1024});
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 8, 1024, 0.7, MaskPattern::kHoles);
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  ASSERT_GT(request.ByteSizeLong(), 32u << 20);
  v1::PackResponse response;
  grpc::Status status = CallPack(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(SameTensor(testing::ReferencePack(x, mask), response.packed(0)));
}

// PackMicroBatches through the generated stub, as a plain protobuf client
// sees it: the plan alone first, then each micro-batch exactly Pack of its
// rows; a reader that stops part way (cancels) or reads slowly leaves the
// server serving; a plan field packd measures itself is INVALID_ARGUMENT.
TEST_F(ServiceTest, PackMicroBatchesStreamsThePlanThenEachMicroBatch) {
  Rng rng = Rng::Fresh();
  const int64_t B = 40, S = 256;
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {B, S, 8});
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kInt8, B, S, 0.6, MaskPattern::kHoles);
  v1::PackMicroBatchesRequest request;
  *request.mutable_batch()->mutable_mask() = ToProto(mask);
  *request.mutable_batch()->add_inputs() = ToProto(x);
  request.mutable_plan()->set_max_tokens_per_micro_batch(600);
  request.mutable_plan()->set_num_ranks(2);
  request.mutable_plan()->set_cost_per_token_squared(1);
  for (int pass = 0; pass < 3; ++pass) {
    grpc::ClientContext context;
    auto reader = stub_->PackMicroBatches(&context, request);
    v1::PackMicroBatchesResponse message;
    ASSERT_TRUE(reader->Read(&message));
    ASSERT_TRUE(message.has_plan());
    EXPECT_FALSE(message.has_packed());
    const v1::PlanResponse plan = message.plan();
    ASSERT_GT(plan.micro_batches_size(), 3);
    int k = 0;
    while (reader->Read(&message)) {
      const v1::MicroBatch& planned = plan.micro_batches(k++);
      EXPECT_FALSE(message.has_plan());
      EXPECT_EQ(message.rank(), planned.rank());
      ASSERT_EQ(message.samples_size(), planned.samples_size());
      const at::Tensor rows =
          at::tensor(std::vector<int64_t>(message.samples().begin(),
                                          message.samples().end()),
                     at::kLong);
      EXPECT_TRUE(SameTensor(testing::ReferencePack(x.index_select(0, rows),
                                                    mask.index_select(0, rows)),
                             message.packed().packed(0)));
      if (pass == 0 && k == 1) context.TryCancel();  // a reader that stops
      if (pass == 1) absl::SleepFor(absl::Milliseconds(20));  // a slow one
    }
    const grpc::Status status = reader->Finish();
    if (pass == 0) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
    } else {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(k, plan.micro_batches_size());
    }
  }
  ExpectStillServing();
  v1::PackMicroBatchesRequest bad = request;
  bad.mutable_plan()->add_lengths(1);
  grpc::ClientContext context;
  auto reader = stub_->PackMicroBatches(&context, bad);
  v1::PackMicroBatchesResponse message;
  EXPECT_FALSE(reader->Read(&message));
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("plan.lengths must be empty"));
  // An input whose rows are shorter than the mask's (found by fuzzing: its
  // rows were gathered past their end before any Pack checked them).
  for (const at::Tensor& wrong :
       {x.narrow(1, 0, S / 2).contiguous(), x.narrow(0, 0, B - 1).contiguous(),
        x.select(2, 0).flatten().contiguous()}) {
    v1::PackMicroBatchesRequest short_rows = request;
    *short_rows.mutable_batch()->mutable_inputs(0) = ToProto(wrong);
    grpc::ClientContext short_context;
    auto short_reader = stub_->PackMicroBatches(&short_context, short_rows);
    EXPECT_FALSE(short_reader->Read(&message));
    const grpc::Status refused = short_reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(refused.error_message(),
                HasSubstr("does not start with batch.mask shape [40, 256]"));
  }
  // A pad_multiple near int64's end (found by fuzzing: a row's padded length
  // overflowed while the rows were measured): the planner refuses the sum,
  // with and without Ulysses' share of it.
  for (int32_t sp : {0, 3}) {
    v1::PackMicroBatchesRequest padded = request;
    padded.mutable_batch()->set_pad_multiple(
        std::numeric_limits<int64_t>::max() - 1);
    padded.mutable_batch()->set_sp_size(sp);
    grpc::ClientContext padded_context;
    auto padded_reader = stub_->PackMicroBatches(&padded_context, padded);
    EXPECT_FALSE(padded_reader->Read(&message));
    const grpc::Status refused = padded_reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(refused.error_message(),
                HasSubstr("the sum of lengths passes 2^53"))
        << "sp_size " << sp;
  }
  ExpectStillServing();
}

TEST_F(ServiceTest, MalformedPackRequestsAreInvalidArgument) {
  const at::Tensor mask =
      at::tensor({1, 0, 1, 1, 0, 0, 1, 1}, at::kByte).view({2, 4});
  const at::Tensor x = at::zeros({2, 4, 3}, at::kFloat);
  v1::PackRequest good;
  *good.mutable_mask() = ToProto(mask);
  *good.add_inputs() = ToProto(x);
  const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;

  v1::PackRequest r = good;
  r.clear_mask();
  ExpectPackError(r, kInvalid, "mask is missing");
  r = good;
  r.mutable_mask()->add_shape(1);
  ExpectPackError(r, kInvalid, "mask.shape [2, 4, 1] must have rank 2");
  r = good;
  *r.mutable_mask() = ToProto(at::ones({8}, at::kByte));
  ExpectPackError(r, kInvalid, "mask.shape [8] must have rank 2 ([B, S])");
  r = good;
  r.clear_inputs();
  ExpectPackError(r, kInvalid, "inputs is empty");
  r = good;
  r.mutable_inputs(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectPackError(r, kInvalid,
                  "inputs[0].dtype DTYPE_UNSPECIFIED is not a supported dtype");
  r = good;
  r.mutable_inputs(0)->set_dtype(static_cast<v1::DType>(42));
  ExpectPackError(r, kInvalid, "inputs[0].dtype 42 is not a supported dtype");
  r = good;
  r.mutable_inputs(0)->set_data("12345");
  ExpectPackError(
      r, kInvalid,
      "inputs[0].data has 5 bytes but shape [2, 4, 3] of float32 needs 96");
  r = good;
  r.mutable_inputs(0)->set_shape(2, -3);
  ExpectPackError(r, kInvalid,
                  "inputs[0].shape [2, 4, -3] has a negative dim at index 2");
  r = good;
  r.mutable_inputs(0)->set_shape(2, int64_t{1} << 62);
  r.mutable_inputs(0)->add_shape(int64_t{1} << 62);
  ExpectPackError(r, kInvalid, "has more elements than int64 can count");
  r = good;
  *r.add_inputs() = ToProto(at::zeros({2, 3, 4}, at::kFloat));
  ExpectPackError(
      r, kInvalid,
      "inputs[1].shape [2, 3, 4] does not start with mask shape [2, 4]");
  r = good;
  r.set_device("gpu:0");
  ExpectPackError(r, kInvalid, "device \"gpu:0\" is not a device");
  r = good;
  r.set_device("cuda:x");
  ExpectPackError(r, kInvalid, "device \"cuda:x\" is not a device");
}

TEST_F(ServiceTest, AbsentDevicesAreFailedPreconditionAndRegionsNotFound) {
  v1::PackRequest r;
  *r.mutable_mask() = ToProto(at::ones({2, 3}, at::kBool));
  *r.add_inputs() = ToProto(at::zeros({2, 3}, at::kFloat));
  r.set_device("cuda:0");
  ExpectPackError(r, grpc::StatusCode::FAILED_PRECONDITION,
                  "cuda:0 is not available");
  r.set_device("hip:1");
  ExpectPackError(r, grpc::StatusCode::FAILED_PRECONDITION,
                  "hip:1 is not available");
  r.set_device("");
  v1::RegionSlice* out = r.add_outputs();
  out->set_region("out");
  out->set_byte_size(24);
  ExpectPackError(r, grpc::StatusCode::NOT_FOUND,
                  "outputs[0]: region \"out\" is not registered");
  r.clear_outputs();
  r.mutable_inputs(0)->mutable_region()->set_region("hidden");
  ExpectPackError(r, grpc::StatusCode::NOT_FOUND,
                  "inputs[0].region: region \"hidden\" is not registered");
}

TEST_F(ServiceTest, MalformedScatterRequestsAreInvalidArgument) {
  const at::Tensor mask =
      at::tensor({1, 0, 1, 1, 0, 0, 1, 1}, at::kByte).view({2, 4});
  v1::ScatterRequest good;
  *good.mutable_mask() = ToProto(mask);
  *good.add_packed() = ToProto(at::zeros({5, 3}, at::kFloat));
  v1::ScatterRequest r = good;
  *r.mutable_packed(0) = ToProto(at::zeros({4, 3}, at::kFloat));
  ExpectScatterError(
      r, grpc::StatusCode::INVALID_ARGUMENT,
      "packed[0].shape [4, 3] has 4 rows but the mask has 5 active positions");
  r = good;
  r.mutable_tail_shape()->add_dims(4);
  ExpectScatterError(r, grpc::StatusCode::INVALID_ARGUMENT,
                     "tail_shape [4] does not match packed[0].shape[1:] [3]");
  r = good;
  *r.mutable_packed(0) = ToProto(at::zeros({}, at::kFloat));
  ExpectScatterError(r, grpc::StatusCode::INVALID_ARGUMENT,
                     "packed[0].shape [] must have rank 1 or more");
  r = good;
  r.clear_packed();
  ExpectScatterError(r, grpc::StatusCode::INVALID_ARGUMENT, "packed is empty");
  // A valid one returns the right dense result.
  v1::ScatterResponse response;
  ASSERT_TRUE(CallScatter(good, &response).ok());
  EXPECT_TRUE(SameTensor(at::zeros({2, 4, 3}, at::kFloat), response.dense(0)));
}

TEST_F(ServiceTest, ServerInfoAnswers) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(
      stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.default_device(), "cpu");
  EXPECT_EQ(info.max_message_bytes(), uint64_t{1} << 30);
  ASSERT_GE(info.devices_size(), 1);
  EXPECT_EQ(info.devices(0).name(), "cpu");
  EXPECT_GT(info.devices(0).memory_bytes(), 0u);
  EXPECT_TRUE(info.shared_memory_enabled());  // loopback listener, auto
  ExpectStillServing();
}

TEST_F(ServiceTest, PlanMicroBatchesKeepsTheRulesAndRefusesBadInput) {
  Rng rng = Rng::Fresh();
  std::vector<int64_t> lengths, loss;
  for (int i = 0; i < 500; ++i) {
    lengths.push_back(1 + rng.Next() % 3000);
    loss.push_back(rng.Next() % (lengths.back() + 1));
  }
  PlanOptions options;
  options.max_tokens_per_micro_batch = 4096;
  options.num_ranks = 4;
  options.micro_batch_multiple = 2;
  v1::PlanRequest request = PlanRequestOf(options, lengths, loss);
  v1::PlanResponse response;
  {
    grpc::ClientContext context;
    grpc::Status status = stub_->PlanMicroBatches(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  // The wire plan is the library's plan, and keeps every rule.
  const Plan plan = PlanOf(response);
  EXPECT_TRUE(CheckPlan(plan, lengths, loss, options).ok())
      << CheckPlan(plan, lengths, loss, options);
  int64_t loss_total = 0;
  for (int64_t v : loss) loss_total += v;
  EXPECT_EQ(response.global_loss_tokens(), loss_total);
  EXPECT_LE(response.imbalance(), 1.01);

  request.set_lengths(3, -5);
  grpc::ClientContext context;
  const grpc::Status bad =
      stub_->PlanMicroBatches(&context, request, &response);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("lengths[3] is -5"));
  ExpectStillServing();
}

// §11 over the wire: a cost model, groups, padding and pipeline order; the
// response is the library's plan, keeps every rule, and is the same bytes
// when asked again (every rank may plan alone); a bad cost is refused.
TEST_F(ServiceTest, PlanMicroBatchesByCostIsDeterministic) {
  Rng rng = Rng::Fresh();
  std::vector<int64_t> lengths, groups;
  for (int i = 0; i < 400; ++i) {
    lengths.push_back(1 + rng.Next() % 6000);
    groups.push_back(i % 3 == 0 ? i / 3 : 1000 + i);  // some pairs and triples
  }
  PlanOptions options;
  options.max_tokens_per_micro_batch = 16384;
  options.num_ranks = 4;
  options.cost_per_token = 24576;
  options.cost_per_token_squared = 1;
  options.pad_multiple = 16;
  options.pipeline_order = true;
  options.groups = groups;
  v1::PlanRequest request = PlanRequestOf(options, lengths, {});
  std::string first;
  for (int attempt = 0; attempt < 2; ++attempt) {
    v1::PlanResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->PlanMicroBatches(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    if (attempt == 0) {
      first = response.SerializeAsString();
      const Plan plan = PlanOf(response);
      EXPECT_TRUE(CheckPlan(plan, lengths, {}, options).ok())
          << CheckPlan(plan, lengths, {}, options);
      EXPECT_EQ(response.global_sequences(), 400);
      EXPECT_LE(response.cost_imbalance(), 1.01);
    } else {
      EXPECT_EQ(response.SerializeAsString(), first);
    }
  }
  request.set_cost_per_token(-1);
  v1::PlanResponse response;
  grpc::ClientContext context;
  const grpc::Status bad =
      stub_->PlanMicroBatches(&context, request, &response);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("cost_per_token is -1"));
  ExpectStillServing();
}

TEST_F(ServiceTest, HealthIsServingForLivenessAndReadiness) {
  EXPECT_EQ(testing::HealthStatus(server_->Channel(), ""), "SERVING");
  EXPECT_EQ(testing::HealthStatus(server_->Channel(), "packd.v1.PackService"),
            "SERVING");
}

// A [B, 0] mask has no bytes, so a 21-byte request can name B = 2^31 rows;
// their metadata is held against the limit before anything is allocated.
TEST(ServiceLimits, ATinyRequestForHugeBIsRefusedAtOnce) {
  auto server = ServerProcess::Start({"--drain_seconds=30"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  for (int64_t rows : {int64_t{1} << 31, int64_t{1} << 40}) {
    v1::PackRequest pack;
    pack.mutable_mask()->set_dtype(v1::DTYPE_BOOL);
    pack.mutable_mask()->add_shape(rows);
    pack.mutable_mask()->add_shape(0);
    v1::Tensor* x = pack.add_inputs();
    x->set_dtype(v1::DTYPE_FLOAT32);
    x->add_shape(rows);
    x->add_shape(0);
    v1::PackResponse response;
    grpc::ClientContext c1;
    c1.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status status = stub->Pack(&c1, pack, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << status.error_message();
    EXPECT_THAT(status.error_message(),
                HasSubstr(absl::StrCat("mask has B = ", rows, " rows")));

    v1::ScatterRequest scatter;
    *scatter.mutable_mask() = pack.mask();
    scatter.add_packed()->set_dtype(v1::DTYPE_FLOAT32);
    scatter.mutable_packed(0)->add_shape(0);
    v1::ScatterResponse dense;
    grpc::ClientContext c2;
    c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    status = stub->Scatter(&c2, scatter, &dense);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << status.error_message();
  }
  // Nothing was left in flight: the drain is immediate.
  const absl::Time start = absl::Now();
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(absl::Seconds(20)), 0) << server->Log();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A process whose libraries start threads before main (OpenBLAS's pool on a
// fresh machine, where libtorch's BLAS is OpenBLAS) has threads that block no
// signal: a SIGTERM the kernel delivers to one of them still drains packd,
// which exits 0 having logged "stopped", and a SIGHUP does not end it.
TEST(ServiceLimits, SignalsDeliveredToAForeignThreadStillDrain) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto server =
        ServerProcess::Start({"--unblocked_thread", "--drain_seconds=10"},
                             ServerProcess::Binary::kTesting);
    ASSERT_NE(server, nullptr);
    server->Signal(SIGHUP);
    EXPECT_THAT(server->LogOnce("received Hangup"),
                HasSubstr("received Hangup"));
    EXPECT_EQ(testing::HealthStatus(server->Channel(), "packd.v1.PackService"),
              "SERVING");
    server->Signal(SIGTERM);
    EXPECT_EQ(server->Wait(absl::Seconds(20)), 0) << server->Log();
    EXPECT_THAT(server->Log(), HasSubstr("received Terminated"));
    EXPECT_THAT(server->Log(), HasSubstr("stopped"));
  }
}

// Whatever a handler throws becomes INTERNAL, and the call is released.
TEST(ServiceLimits, AnExceptionInAHandlerIsInternalAndReleasesTheCall) {
  auto server = ServerProcess::Start({"--call_throws", "--drain_seconds=30"},
                                     ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(at::ones({1, 2}, at::kBool));
  *request.add_inputs() = ToProto(at::zeros({1, 2}, at::kFloat));
  v1::PackResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub->Pack(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(status.error_message(),
              HasSubstr("Pack failed: injected by --call_throws"));
  EXPECT_EQ(testing::HealthStatus(server->Channel(), "packd.v1.PackService"),
            "SERVING");
  const absl::Time start = absl::Now();
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(absl::Seconds(20)), 0) << server->Log();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// --max_inflight_bytes: a call that would pass the budget waits for room
// until (just before) its deadline; one larger than the whole budget is
// refused at once. Each call here holds about 3.2 MB (request, inline input,
// result) for two seconds. The metrics show the waiting call.
TEST(ServiceLimits, InflightBudgetMakesCallsWaitAndRefusesTheTooLarge) {
  auto server = ServerProcess::Start(
      {"--call_delay_ms=2000", "--max_inflight_bytes=4000000",
       "--metrics_listen=127.0.0.1:0"},
      ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  const std::string metrics = server->MetricsAddress();
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();
  const at::Tensor mask = at::ones({4, 64}, at::kBool);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kFloat32, {4, 64, 1024});
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  auto call = [&](absl::Duration deadline, v1::PackResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub->Pack(&context, request, response);
  };

  v1::PackRequest too_large = request;
  *too_large.mutable_inputs(0) =
      ToProto(testing::RandomTensor(rng, DType::kFloat32, {4, 64, 2048}));
  v1::PackResponse ignored;
  grpc::ClientContext c0;
  absl::Time start = absl::Now();
  grpc::Status status = stub->Pack(&c0, too_large, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_inflight_bytes"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));  // no delay hook

  v1::PackResponse first_response;
  std::thread first(
      [&] { EXPECT_TRUE(call(absl::Seconds(20), &first_response).ok()); });
  absl::SleepFor(absl::Milliseconds(300));  // the first call holds its bytes
  std::string while_waiting;
  std::thread scrape([&] {
    absl::SleepFor(absl::Milliseconds(400));  // the next call waits
    while_waiting = HttpGet(metrics, "/metrics");
  });
  v1::PackResponse waited;
  status = call(absl::Seconds(1), &waited);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  scrape.join();
  EXPECT_THAT(while_waiting, HasSubstr("packd_budget_waiting 1\n"));
  EXPECT_THAT(while_waiting, HasSubstr("packd_budget_bytes_limit 4000000\n"));
  EXPECT_THAT(while_waiting, HasSubstr("packd_calls_in_flight 2\n"));
  EXPECT_THAT(while_waiting, HasSubstr("packd_budget_bytes_in_use "));
  EXPECT_THAT(while_waiting, Not(HasSubstr("packd_budget_bytes_in_use 0\n")));
  EXPECT_THAT(status.error_message(), HasSubstr("deadline"));
  start = absl::Now();
  v1::PackResponse second_response;
  status = call(absl::Seconds(20), &second_response);  // waits, then runs
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(absl::Now() - start, absl::Milliseconds(900));
  first.join();
  EXPECT_TRUE(
      SameTensor(testing::ReferencePack(x, mask), second_response.packed(0)));
  EXPECT_TRUE(
      SameTensor(testing::ReferencePack(x, mask), first_response.packed(0)));
}

// Ops run on packd's workers, never on the memory budget's thread: a Scatter
// that outgrew its reservation, granted more by the budget once another call
// finished, ran its whole op there, so no other waiter's deadline was kept
// meanwhile. Here A (a Pack) holds the budget through a 2.5 s op; S (a Scatter
// whose 10 MiB of results outgrow its declared 0.5 MiB request) waits for room
// and then takes 2.5 s itself; W, waiting behind S with a 1 s deadline, must
// hear RESOURCE_EXHAUSTED from packd at its deadline (it heard its own
// DEADLINE_EXCEEDED while the budget's thread ran S's op).
TEST(ServiceLimits, ASlowOpNeverHoldsUpTheBudgetsDeadlines) {
  auto server = ServerProcess::Start(
      {"--call_delay_ms=2500", "--max_inflight_bytes=20000000", "--threads=4"},
      ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();
  auto call = [&](auto method, const auto& request, auto* response,
                  absl::Duration deadline, bool declare) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    if (declare) {
      context.AddMetadata("packd-request-bytes",
                          std::to_string(request.ByteSizeLong()));
    }
    return ((*stub).*method)(&context, request, response);
  };

  const at::Tensor a_mask = at::ones({6, 256}, at::kBool);
  const at::Tensor a_x =
      testing::RandomTensor(rng, DType::kFloat32, {6, 256, 1024});  // 6 MiB
  v1::PackRequest a;
  *a.mutable_mask() = ToProto(a_mask);
  *a.add_inputs() = ToProto(a_x);
  const at::Tensor s_mask = testing::RandomMask(rng, DType::kBool, 10, 256,
                                                0.05, MaskPattern::kHoles);
  const int64_t active = s_mask.sum().item<int64_t>();
  const at::Tensor s_packed =
      testing::RandomTensor(rng, DType::kFloat32, {active, 1024});
  v1::ScatterRequest s;
  *s.mutable_mask() = ToProto(s_mask);
  *s.add_packed() = ToProto(s_packed);

  v1::PackResponse a_response, w_response;
  v1::ScatterResponse s_response;
  grpc::Status a_status, s_status;
  std::thread a_thread([&] {
    a_status = call(&v1::PackService::Stub::Pack, a, &a_response,
                    absl::Seconds(30), true);
  });
  absl::SleepFor(absl::Milliseconds(500));  // A holds its bytes in its op
  std::thread s_thread([&] {
    s_status = call(&v1::PackService::Stub::Scatter, s, &s_response,
                    absl::Seconds(30), true);
  });
  absl::SleepFor(absl::Milliseconds(2700));  // A is done, S in its op
  const grpc::Status w_status = call(&v1::PackService::Stub::Pack, a,
                                     &w_response, absl::Seconds(1), false);
  EXPECT_EQ(w_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << w_status.error_message();
  EXPECT_THAT(w_status.error_message(), HasSubstr("deadline"));
  a_thread.join();
  s_thread.join();
  ASSERT_TRUE(a_status.ok()) << a_status.error_message();
  ASSERT_TRUE(s_status.ok()) << s_status.error_message();
  EXPECT_TRUE(
      SameTensor(testing::ReferencePack(a_x, a_mask), a_response.packed(0)));
  EXPECT_TRUE(
      SameTensor(testing::ReferenceScatter(s_packed, s_mask, {10, 256, 1024}),
                 s_response.dense(0)));
}

// Design §2: a call whose inputs total at most 64 KiB runs on the gRPC thread
// that read it, never queued behind the workers. With the one worker held by
// a step (2.5 s), a small Pack and a small Scatter sent meanwhile are
// answered before it ends, each equal to torch's; a large Pack sent then is
// served by the worker once it is free.
TEST(ServiceLimits, SmallCallsAreServedWhileTheWorkersAreBusy) {
  auto server = ServerProcess::Start(
      {"--call_delay_ms=2500", "--call_delay_methods=PackMicroBatches",
       "--threads=1"},
      ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();
  v1::PackMicroBatchesRequest step;
  const at::Tensor step_mask = at::ones({8, 64}, at::kBool);
  *step.mutable_batch()->mutable_mask() = ToProto(step_mask);
  *step.mutable_batch()->add_inputs() = ToProto(step_mask.to(at::kLong));
  step.mutable_plan()->set_max_tokens_per_micro_batch(128);
  step.mutable_plan()->set_num_ranks(1);
  const at::Tensor large_x =
      testing::RandomTensor(rng, DType::kFloat32, {4, 64, 256});  // 256 KiB
  const at::Tensor large_mask = at::ones({4, 64}, at::kBool);
  v1::PackRequest large;
  *large.mutable_mask() = ToProto(large_mask);
  *large.add_inputs() = ToProto(large_x);
  const at::Tensor small_x =
      testing::RandomTensor(rng, DType::kBFloat16, {4, 128, 64});  // 64 KiB
  const at::Tensor small_mask =
      testing::RandomMask(rng, DType::kBool, 4, 128, 0.5, MaskPattern::kHoles);
  v1::PackRequest small;
  *small.mutable_mask() = ToProto(small_mask);
  *small.add_inputs() = ToProto(small_x);

  std::atomic<bool> step_done{false};
  grpc::Status step_status;
  std::thread step_thread([&] {
    grpc::ClientContext context;
    auto reader = stub->PackMicroBatches(&context, step);
    v1::PackMicroBatchesResponse message;
    while (reader->Read(&message)) {
    }
    step_status = reader->Finish();
    step_done = true;
  });
  absl::SleepFor(absl::Milliseconds(500));  // the step holds the worker
  grpc::Status large_status;
  v1::PackResponse large_response;
  std::thread large_thread([&] {
    grpc::ClientContext context;
    large_status = stub->Pack(&context, large, &large_response);
  });

  grpc::ClientContext context;
  v1::PackResponse response;
  const grpc::Status status = stub->Pack(&context, small, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(step_done) << "the small Pack waited for the worker";
  EXPECT_TRUE(SameTensor(testing::ReferencePack(small_x, small_mask),
                         response.packed(0)));
  v1::ScatterRequest scatter;
  *scatter.mutable_mask() = ToProto(small_mask);
  *scatter.add_packed() = response.packed(0);
  grpc::ClientContext scatter_context;
  v1::ScatterResponse scattered;
  const grpc::Status scatter_status =
      stub->Scatter(&scatter_context, scatter, &scattered);
  ASSERT_TRUE(scatter_status.ok()) << scatter_status.error_message();
  EXPECT_FALSE(step_done) << "the small Scatter waited for the worker";
  EXPECT_TRUE(SameTensor(
      at::where(small_mask.unsqueeze(-1), small_x, at::zeros_like(small_x)),
      scattered.dense(0)));

  step_thread.join();
  large_thread.join();
  ASSERT_TRUE(step_status.ok()) << step_status.error_message();
  ASSERT_TRUE(large_status.ok()) << large_status.error_message();
  EXPECT_TRUE(SameTensor(testing::ReferencePack(large_x, large_mask),
                         large_response.packed(0)));
}

// The budget holds requests back at their senders: 32 clients, each on its
// own connection whose flow-control windows an earlier call has grown, send a
// 16 MiB inline Pack at once to a server whose budget admits one at a time.
// The server's peak memory grows by no more than the budget plus a fixed
// overhead; gRPC would otherwise receive all 512 MiB before any handler ran.
TEST(ServiceLimits, CallsWaitingForTheBudgetStayWithTheirSenders) {
  constexpr int64_t kBudget = int64_t{50} << 20;  // a call needs up to 48
  auto server =
      ServerProcess::Start({absl::StrCat("--max_inflight_bytes=", kBudget),
                            "--max_message_bytes=25165824"});
  ASSERT_NE(server, nullptr);
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 16, 256, 0.5, MaskPattern::kHoles);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kFloat32, {16, 256, 1024});
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  const at::Tensor expected = testing::ReferencePack(x, mask);

  constexpr int kClients = 32;
  std::atomic<int> warm{0};
  std::atomic<bool> go{false};
  std::atomic<int> ok{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetInt("packd.test.connection", i);  // a connection of its own
      auto stub = v1::PackService::NewStub(grpc::CreateCustomChannel(
          server->address(), grpc::InsecureChannelCredentials(), args));
      auto call = [&] {
        grpc::ClientContext context;
        context.set_deadline(
            absl::ToChronoTime(absl::Now() + absl::Minutes(2)));
        v1::PackResponse response;
        const grpc::Status status = stub->Pack(&context, request, &response);
        EXPECT_TRUE(status.ok()) << status.error_message();
        return status.ok() && SameTensor(expected, response.packed(0));
      };
      EXPECT_TRUE(call());
      ++warm;
      while (!go) absl::SleepFor(absl::Milliseconds(1));
      if (call()) ++ok;
    });
  }
  while (warm < kClients) absl::SleepFor(absl::Milliseconds(1));
  // Resets the server's peak resident memory (VmHWM) to what it holds now.
  std::ofstream(absl::StrCat("/proc/", server->pid(), "/clear_refs")) << "5";
  const int64_t before = testing::ProcStatusBytes(server->pid(), "VmRSS:");
  ASSERT_GT(before, 0);
  go = true;
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(ok.load(), kClients);
  const int64_t peak = testing::ProcStatusBytes(server->pid(), "VmHWM:");
  // The overhead: HTTP/2's 64 KiB window of each waiting stream, gRPC's
  // buffers, and what the allocator keeps of freed buffers.
  constexpr int64_t kOverhead = int64_t{24} << 20;
  std::printf("peak resident memory grew by %.1f MiB over the calls\n",
              (peak - before) / 1048576.0);
  // A sanitizer's allocator keeps freed memory in quarantine: no bound.
  if (std::getenv("ASAN_OPTIONS") == nullptr &&
      std::getenv("TSAN_OPTIONS") == nullptr) {
    EXPECT_LT(peak - before, kBudget + kOverhead)
        << "peak " << peak << " bytes, " << before << " before the calls";
  }
}

// A client may declare its request's size (packd-request-bytes) so that the
// budget admits it for what it needs; a request larger than it declared, and
// a declaration that is not a positive number, are refused. Unknown methods
// get UNIMPLEMENTED naming them.
TEST(ServiceLimits, DeclaredRequestSizesAreHeldToTheirWord) {
  auto server = ServerProcess::Start({"--max_inflight_bytes=100000000"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 32, 0.5, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat16, {4, 32, 8});
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);
  const size_t size = request.ByteSizeLong();
  auto call = [&](const std::string& declared, v1::PackResponse* response) {
    grpc::ClientContext context;
    context.AddMetadata("packd-request-bytes", declared);
    return stub->Pack(&context, request, response);
  };
  v1::PackResponse response;
  grpc::Status status = call(std::to_string(size), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(SameTensor(testing::ReferencePack(x, mask), response.packed(0)));

  status = call(std::to_string(size - 1), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("the request has ", size,
                                     " bytes, more than the ", size - 1)));
  // Declared over --max_message_bytes: refused before the request is read.
  status = call("2000000000", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_message_bytes"));
  for (const char* bad : {"", "0", "-5", "12abc", "99999999999999999999"}) {
    status = call(bad, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(status.error_message(),
                HasSubstr("packd-request-bytes must be a positive number"));
  }

  grpc::GenericStub generic(server->Channel());
  grpc::ClientContext context;
  grpc::Slice nothing("");
  grpc::ByteBuffer empty(&nothing, 1), reply;
  grpc::Status unknown;
  absl::Notification done;
  generic.UnaryCall(&context, "/packd.v1.PackService/Unpack",
                    grpc::StubOptions(), &empty, &reply, [&](grpc::Status s) {
                      unknown = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(unknown.error_message(),
              HasSubstr("/packd.v1.PackService/Unpack"));

  grpc::ClientContext last;  // still serving
  EXPECT_TRUE(stub->Pack(&last, request, &response).ok());
}

TEST(ServiceLimits, OversizedRequestsAndResponsesAreResourceExhausted) {
  auto server = ServerProcess::Start({"--max_message_bytes=1048576"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  Rng rng = Rng::Fresh();

  v1::PackRequest big;
  *big.mutable_mask() = ToProto(at::ones({4, 64}, at::kBool));
  *big.add_inputs() =
      ToProto(testing::RandomTensor(rng, DType::kFloat32, {4, 64, 1024}));
  v1::PackResponse response;
  grpc::ClientContext c1;
  grpc::Status status = stub->Pack(&c1, big, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(
      status.error_message(),
      HasSubstr(
          "over the server's limit of 1048576 bytes (--max_message_bytes)"));

  // A small request whose result would be too large.
  at::Tensor mask = at::zeros({64, 1024}, at::kBool);
  mask[0][0] = true;
  v1::ScatterRequest scatter;
  *scatter.mutable_mask() = ToProto(mask);
  *scatter.add_packed() = ToProto(at::zeros({1, 16}, at::kFloat));
  v1::ScatterResponse scatter_response;
  grpc::ClientContext c2;
  status = stub->Scatter(&c2, scatter, &scatter_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("the response would hold at least"));
  EXPECT_THAT(status.error_message(), HasSubstr("--max_message_bytes"));

  // A plan whose micro-batches alone would pass the limit: 1 MiB / 8 bytes
  // is 131,072 slots; 200,000 one-token samples at a budget of 1 need more.
  v1::PlanRequest plan;
  const std::vector<int64_t> ones(200000, 1);
  plan.mutable_lengths()->Assign(ones.begin(), ones.end());
  plan.set_max_tokens_per_micro_batch(1);
  v1::PlanResponse plan_response;
  grpc::ClientContext c4;
  status = stub->PlanMicroBatches(&c4, plan, &plan_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("at least 200000 micro-batches on each of 1 ranks"));
  EXPECT_THAT(status.error_message(), HasSubstr("--max_message_bytes"));

  // Still serving.
  v1::PackRequest small;
  *small.mutable_mask() = ToProto(at::ones({1, 2}, at::kBool));
  *small.add_inputs() = ToProto(at::zeros({1, 2}, at::kFloat));
  grpc::ClientContext c3;
  EXPECT_TRUE(stub->Pack(&c3, small, &response).ok());
}

TEST(ServiceShutdown, SigtermDrainsACallInFlightAndExitsZero) {
  // Every call waits 1.5 s inside the server, so the SIGTERM lands while it
  // runs.
  auto server =
      ServerProcess::Start({"--call_delay_ms=1500", "--drain_seconds=30"},
                           ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  Rng rng = Rng::Fresh();
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kBFloat16, {16, 512, 1024});
  const at::Tensor mask = testing::RandomMask(rng, DType::kBool, 16, 512, 0.3,
                                              MaskPattern::kPrefix);
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = ToProto(x);  // 16 MiB
  auto channel = server->Channel();
  auto in_flight = std::async(std::launch::async, [&] {
    auto stub = v1::PackService::NewStub(channel);
    grpc::ClientContext context;
    v1::PackResponse response;
    grpc::Status status = stub->Pack(&context, request, &response);
    return std::make_pair(status, response);
  });
  absl::SleepFor(absl::Milliseconds(900));
  EXPECT_EQ(testing::HealthStatus(channel, "packd.v1.PackService"), "SERVING");
  server->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(testing::HealthStatus(channel, "packd.v1.PackService"),
            "NOT_SERVING");
  {
    auto stub = v1::PackService::NewStub(channel);
    grpc::ClientContext context;
    v1::PackResponse response;
    grpc::Status status = stub->Pack(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << status.error_message();
  }
  auto [status, response] = in_flight.get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(SameTensor(testing::ReferencePack(x, mask), response.packed(0)));
  EXPECT_EQ(server->Wait(), 0) << server->Log();
  EXPECT_THAT(server->Log(), HasSubstr("draining"));
}

TEST(ServiceMetrics, PrometheusTextCountsCallsByMethodAndCode) {
  auto server = ServerProcess::Start({"--metrics_listen=127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  const std::string metrics = server->MetricsAddress();
  ASSERT_FALSE(metrics.empty()) << server->Log();

  auto stub = v1::PackService::NewStub(server->Channel());
  v1::PackRequest good;
  *good.mutable_mask() = ToProto(at::ones({2, 3}, at::kBool));
  *good.add_inputs() = ToProto(at::zeros({2, 3, 4}, at::kFloat));
  v1::PackResponse response;
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Pack(&context, good, &response).ok());
  }
  v1::PackRequest bad = good;
  bad.clear_mask();
  grpc::ClientContext context;
  EXPECT_FALSE(stub->Pack(&context, bad, &response).ok());

  // A call counts as in flight until its reply has left, which may be just
  // after the client has it: the gauge returns to 0 soon after.
  std::string text = HttpGet(metrics, "/metrics");
  for (int i = 0;
       i < 100 && !absl::StrContains(text, "packd_calls_in_flight 0\n"); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    text = HttpGet(metrics, "/metrics");
  }
  EXPECT_THAT(text, HasSubstr(" 200 OK\r\n"));
  // The three Packs ran on the CPU, and so did the start-up self-check; the
  // malformed one never reached it.
  for (const char* line :
       {"packd_requests_total{code=\"ok\",method=\"Pack\"} 3\n",
        "packd_requests_total{code=\"invalid_argument\",method=\"Pack\"} 1\n",
        "packd_request_duration_seconds_count{method=\"Pack\"} 4\n",
        "packd_request_duration_seconds_bucket{method=\"Pack\",le=\"+Inf\"} "
        "4\n",
        "packd_regions{kind=\"system\"} 0\n", "packd_calls_in_flight 0\n",
        "packd_device_calls_total{device=\"cpu\"} 4\n",
        "packd_device_errors_total{device=\"cpu\"} 0\n",
        "packd_budget_bytes_in_use 0\n", "packd_budget_waiting 0\n"}) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  EXPECT_THAT(HttpGet(metrics, "/other"), HasSubstr(" 404 Not Found\r\n"));
}

TEST(ServiceStartup, AbsentDefaultDeviceFailsClearly) {
  EXPECT_EQ(ServerProcess::Start({"--device=cuda:0"}), nullptr);
}

// A second packd on an address a server listens on exits with a clear error
// rather than sharing the TCP port or replacing the unix socket, and the first
// keeps serving.
TEST(ServiceStartup, AnAddressInUseIsRefusedNotShared) {
  for (const std::string listen :
       {absl::StrCat("127.0.0.1:", testing::UnusedPort()), std::string()}) {
    auto first = ServerProcess::Start(
        listen.empty() ? std::vector<std::string>{}
                       : std::vector<std::string>{"--listen=" + listen});
    ASSERT_NE(first, nullptr);
    std::string out;
    EXPECT_EQ(testing::RunCommand(
                  "timeout 30 " +
                      testing::PackdCommand("--listen=" + first->address()),
                  &out),
              1);
    EXPECT_THAT(out, HasSubstr(absl::StrCat("cannot listen on ",
                                            first->address(), " (--listen)")));
    EXPECT_EQ(testing::HealthStatus(first->Channel(), "packd.v1.PackService"),
              "SERVING");
    first->Signal(SIGTERM);
    EXPECT_EQ(first->Wait(), 0) << first->Log();
  }
}

}  // namespace
}  // namespace packd

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::ServerProcess;
using testing::ToProto;

// --auth_token_file: every PackService call needs a current bearer token;
// health never does; SIGHUP reloads the file.
TEST(ServiceAuth, BearerTokensGuardEveryCallButHealth) {
  char dir[] = "/tmp/packd-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = absl::StrCat(dir, "/tokens");
  auto write = [&](const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
  };
  write("\n  alpha-123  \nsecond-token\n");
  auto server = ServerProcess::Start({"--auth_token_file=" + path});
  ASSERT_NE(server, nullptr);
  auto stub = v1::PackService::NewStub(server->Channel());
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(at::ones({1, 2}, at::kBool));
  *request.add_inputs() = ToProto(at::zeros({1, 2}, at::kFloat));
  auto pack = [&](const char* authorization) {
    grpc::ClientContext context;
    if (authorization != nullptr) {
      context.AddMetadata("authorization", authorization);
    }
    v1::PackResponse response;
    return stub->Pack(&context, request, &response);
  };
  grpc::Status status = pack(nullptr);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("requires a bearer token"));
  status = pack("Basic YWxwaGE=");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  status = pack("Bearer alpha-12");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("not valid"));
  EXPECT_TRUE(pack("Bearer alpha-123").ok());
  EXPECT_TRUE(pack("Bearer second-token").ok());
  {
    grpc::ClientContext context;
    v1::ServerInfo info;
    EXPECT_EQ(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext c2;
    v1::ListRegionsResponse regions;
    EXPECT_EQ(
        stub->ListRegions(&c2, v1::ListRegionsRequest(), &regions).error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(testing::HealthStatus(server->Channel(), ""), "SERVING");
  EXPECT_EQ(testing::HealthStatus(server->Channel(), "packd.v1.PackService"),
            "SERVING");

  // A new file on SIGHUP: the old token is stale at once.
  write("beta-456\n");
  server->Signal(SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (pack("Bearer alpha-123").ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(pack("Bearer alpha-123").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(pack("Bearer beta-456").ok());
  // An empty file is refused: the tokens stay.
  write("\n");
  server->Signal(SIGHUP);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(pack("Bearer beta-456").ok());
  EXPECT_THAT(server->Log(), HasSubstr("holds no token"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace packd
