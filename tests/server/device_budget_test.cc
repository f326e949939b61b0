// What the server asks of a device per call, counted on the fake GPU
// (kernels/device_counters.h): host synchronisations, stream operations and
// bytes copied. A GPU is idle while the host waits on it, and every operation
// has a fixed cost of microseconds, so these are the budgets that decide
// whether packd keeps up with the GPU; they are deterministic here, and the
// same counters are read on a real device (tests/gpu/run_gpu_checks.sh).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_counters.h"
#include "tests/e2e/proto_util.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"
#include "tests/kernels/test_util.h"
#include "tests/server/fake_gpu_fixture.h"

namespace packd {
namespace {

using testing::InRegion;
using testing::Slice;
using testing::ToProto;

DeviceCounts Now() { return DeviceCounters::Of(DeviceKind::kCuda).Read(); }

std::string Describe(const DeviceCounts& c) {
  return absl::StrCat(c.synchronizations, " synchronisations, ",
                      c.total_operations(), " stream operations (",
                      c.ops(DeviceOp::kKernel), " kernels, ",
                      c.ops(DeviceOp::kMemset), " memsets, ",
                      c.ops(DeviceOp::kCopyHostToDevice), " H2D, ",
                      c.ops(DeviceOp::kCopyDeviceToHost), " D2H, ",
                      c.ops(DeviceOp::kCopyDeviceToDevice), " D2D), ",
                      c.bytes(DeviceOp::kCopyHostToDevice), " bytes H2D, ",
                      c.bytes(DeviceOp::kCopyDeviceToHost), " bytes D2H, ",
                      c.pool_acquisitions, " pool acquisitions");
}

// The step of docs/performance.md's device table, smaller in S: [64, 512]
// token ids and log-probs, rows of 16 to 512 active tokens in documents of 1
// to 96, padded to 8, the token ids shifted, a loss mask, 4 ranks; every
// tensor on the device.
struct StepBatch {
  int64_t B = 64, S = 512;
  at::Tensor mask, ids, logprobs, segment_ids, loss_mask;
  int64_t documents = 0;

  explicit StepBatch(testing::Rng& rng) {
    mask = at::zeros({B, S}, at::kBool);
    segment_ids = at::zeros({B, S}, at::kInt);
    int* seg = segment_ids.data_ptr<int>();
    for (int64_t r = 0; r < B; ++r) {
      const int64_t length = 16 + static_cast<int64_t>(rng.Next() % (S - 15));
      mask[r].slice(0, 0, length).fill_(true);
      for (int64_t at = 0, id = 0; at < length; ++id) {
        const int64_t n = 1 + static_cast<int64_t>(rng.Next() % 96);
        for (int64_t k = at; k < std::min(at + n, length); ++k) {
          seg[r * S + k] = static_cast<int>(id);
        }
        at += n;
        ++documents;
      }
    }
    ids = testing::RandomTensor(rng, DType::kInt64, {B, S});
    logprobs = testing::RandomTensor(rng, DType::kFloat32, {B, S});
    loss_mask = mask & testing::RandomMask(rng, DType::kBool, B, S, 0.9,
                                           MaskPattern::kHoles);
  }
  std::vector<at::Tensor> Tensors() const {
    return {mask, ids, logprobs, segment_ids, loss_mask};
  }
};

class DeviceBudgetTest : public FakeGpuTest {
 protected:
  struct Ran {
    grpc::Status status;
    std::vector<v1::PackMicroBatchesResponse> messages;
    DeviceCounts cost;
  };
  Ran RunStep(const v1::PackMicroBatchesRequest& request) {
    grpc::ClientContext context;
    Ran ran;
    const DeviceCounts before = Now();
    auto reader = stub_->PackMicroBatches(&context, request);
    v1::PackMicroBatchesResponse message;
    while (reader->Read(&message)) ran.messages.push_back(message);
    ran.status = reader->Finish();
    ran.cost = Now() - before;
    return ran;
  }
};

TEST_F(DeviceBudgetTest, AStepOnTheDeviceSynchronisesAtMostFourTimes) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const StepBatch batch(rng);
  // The batch in one device region, its tensors from multiples of 256.
  std::vector<uint64_t> at;
  uint64_t next = 0;
  for (const at::Tensor& t : batch.Tensors()) {
    at.push_back(next);
    next = (next + t.nbytes() + 255) / 256 * 256;
  }
  DeviceBuffer memory(0, next);
  for (size_t i = 0; i < at.size(); ++i) memory.Put(batch.Tensors()[i], at[i]);
  ASSERT_TRUE(RegisterDevice("batch", memory, "cuda:0", next).ok());

  v1::PackMicroBatchesRequest request;
  v1::PackRequest* b = request.mutable_batch();
  b->set_device("cuda:0");
  *b->mutable_mask() = InRegion(batch.mask, "batch", at[0]);
  *b->add_inputs() = InRegion(batch.ids, "batch", at[1]);
  *b->add_inputs() = InRegion(batch.logprobs, "batch", at[2]);
  *b->mutable_segment_ids() = InRegion(batch.segment_ids, "batch", at[3]);
  *request.mutable_loss_mask() = InRegion(batch.loss_mask, "batch", at[4]);
  b->set_pad_multiple(8);
  b->set_with_position_ids(true);
  v1::Shift* shift = b->add_shifts();
  shift->set_input(0);
  shift->set_fill(-100);
  request.mutable_plan()->set_max_tokens_per_micro_batch(1200);
  request.mutable_plan()->set_num_ranks(4);

  // The first run sizes the outputs (its plan says how many bytes); the
  // second writes them into an arena on the device, as a trainer's steps do.
  const Ran sizing = RunStep(request);
  ASSERT_TRUE(sizing.status.ok()) << sizing.status.error_message();
  const int64_t output_bytes = sizing.messages[0].output_bytes();
  DeviceBuffer arena(0, output_bytes);
  ASSERT_TRUE(RegisterDevice("arena", arena, "cuda:0", output_bytes).ok());
  *request.mutable_outputs() = Slice("arena", 0, output_bytes);
  const Ran ran = RunStep(request);
  ASSERT_TRUE(ran.status.ok()) << ran.status.error_message();
  const int64_t micro_batches = static_cast<int64_t>(ran.messages.size()) - 1;
  ASSERT_GE(micro_batches, 16);
  std::printf(
      "a [%lld, %lld] step of %lld micro-batches (%lld documents): %s\n",
      static_cast<long long>(batch.B), static_cast<long long>(batch.S),
      static_cast<long long>(micro_batches),
      static_cast<long long>(batch.documents), Describe(ran.cost).c_str());
  EXPECT_LE(ran.cost.synchronizations, 4) << Describe(ran.cost);
  EXPECT_LE(ran.cost.total_operations(), 6 * micro_batches + 10)
      << Describe(ran.cost);
  // The plan table: for each micro-batch's result (3: two inputs and the
  // shift), a run of rows per document and per row's padding, 24 bytes each.
  const int64_t table =
      24 * 3 * (2 * batch.documents + 2 * batch.B + micro_batches);
  EXPECT_LE(ran.cost.bytes(DeviceOp::kCopyHostToDevice), table + (64 << 10))
      << Describe(ran.cost);
  ASSERT_TRUE(Unregister("arena").ok());
  ASSERT_TRUE(Unregister("batch").ok());
}

// A Pack of x ([B, S, H] in a device region) whose mask has `density`
// active positions: its results inline (kInline), into a slice of an arena on
// the device that holds x whole (kRoomForAll), or exactly the result
// (kExact).
enum class Into { kInline, kRoomForAll, kExact };

class PackBudgetTest : public DeviceBudgetTest {
 protected:
  DeviceCounts Pack(Into into, double density = 0.3) {
    testing::Rng rng = testing::Rng::Fresh();
    const int64_t B = 16, S = 256, H = 64;
    const at::Tensor mask = testing::RandomMask(rng, DType::kBool, B, S,
                                                density, MaskPattern::kHoles);
    const at::Tensor x =
        testing::RandomTensor(rng, DType::kBFloat16, {B, S, H});
    const at::Tensor expected = testing::ReferencePack(x, mask);
    DeviceBuffer in(0, x.nbytes() + mask.nbytes()), out(0, x.nbytes() + 1);
    in.Put(x);
    in.Put(mask, x.nbytes());
    EXPECT_TRUE(
        RegisterDevice("in", in, "cuda:0", x.nbytes() + mask.nbytes()).ok());
    EXPECT_TRUE(RegisterDevice("out", out, "cuda:0", x.nbytes()).ok());
    v1::PackRequest request;
    request.set_device("cuda:0");
    *request.mutable_mask() = InRegion(mask, "in", x.nbytes());
    *request.add_inputs() = InRegion(x, "in", 0);
    if (into != Into::kInline) {
      *request.add_outputs() = Slice(
          "out", 0, into == Into::kExact ? expected.nbytes() : x.nbytes());
    }
    v1::PackResponse response;
    grpc::ClientContext context;
    const DeviceCounts before = Now();
    const grpc::Status status = stub_->Pack(&context, request, &response);
    const DeviceCounts cost = Now() - before;
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (into == Into::kInline) {
      EXPECT_TRUE(testing::SameTensor(expected, response.packed(0)));
    } else {
      EXPECT_TRUE(testing::SameBytesAt(expected, out.data()));
      EXPECT_EQ(response.packed(0).region().byte_size(), expected.nbytes());
      // Nothing past the result is written.
      int64_t touched = 0;
      for (int64_t at = expected.nbytes(); at <= x.nbytes(); ++at) {
        touched += static_cast<uint8_t>(out.data()[at]) != testing::kCanary;
      }
      EXPECT_EQ(touched, 0);
    }
    EXPECT_EQ(response.total_active(), expected.size(0));
    EXPECT_TRUE(Unregister("in").ok());
    EXPECT_TRUE(Unregister("out").ok());
    std::printf("a Pack %s, density %.1f: %s\n",
                into == Into::kInline       ? "inline"
                : into == Into::kRoomForAll ? "into the caller's outputs"
                                            : "into an exact slice",
                density, Describe(cost).c_str());
    return cost;
  }
};

TEST_F(PackBudgetTest, APackIntoTheCallersOutputsSynchronisesOnce) {
  StartServer();
  for (double density : {0.0, 0.3, 1.0}) {
    const DeviceCounts cost = Pack(Into::kRoomForAll, density);
    EXPECT_EQ(cost.synchronizations, 1) << Describe(cost);
  }
}

TEST_F(PackBudgetTest, APackThatSizesItsResultsSynchronisesTwice) {
  StartServer();
  for (double density : {0.0, 0.3, 1.0}) {
    const DeviceCounts cost = Pack(Into::kInline, density);
    EXPECT_LE(cost.synchronizations, 2) << Describe(cost);
  }
  // A slice with room for the result only: the sizes are needed before
  // anything is written into it.
  const DeviceCounts cost = Pack(Into::kExact);
  EXPECT_EQ(cost.synchronizations, 2) << Describe(cost);
}

// A Pack with documents and a layout (padded to 8, the token ids shifted,
// position ids) of tensors in a device region, results inline: each result
// laid out on the device, the layout's tables up and the documents' ids and
// positions back without a wait each.
TEST_F(PackBudgetTest, APackWithALayoutWaitsAtMostThreeTimes) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const int64_t B = 8, S = 300, H = 16;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.7, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {B, S, H});
  const at::Tensor ids = testing::RandomTensor(rng, DType::kInt64, {B, S});
  // Documents of 1 to 5 tokens, from the test's own seed.
  at::Tensor segments = at::zeros({B, S}, at::kInt);
  int* seg = segments.data_ptr<int>();
  for (int64_t k = 1; k < B * S; ++k) {
    seg[k] = seg[k - 1] + (rng.Next() % 3 == 0 ? 1 : 0);
  }
  const std::vector<at::Tensor> tensors = {x, ids, mask, segments};
  std::vector<uint64_t> at;
  uint64_t next = 0;
  for (const at::Tensor& t : tensors) {
    at.push_back(next);
    next = (next + t.nbytes() + 255) / 256 * 256;
  }
  DeviceBuffer memory(0, next);
  for (size_t i = 0; i < tensors.size(); ++i) memory.Put(tensors[i], at[i]);
  ASSERT_TRUE(RegisterDevice("batch", memory, "cuda:0", next).ok());
  v1::PackRequest request;
  request.set_device("cuda:0");
  *request.add_inputs() = InRegion(x, "batch", at[0]);
  *request.add_inputs() = InRegion(ids, "batch", at[1]);
  *request.mutable_mask() = InRegion(mask, "batch", at[2]);
  *request.mutable_segment_ids() = InRegion(segments, "batch", at[3]);
  request.set_pad_multiple(8);
  request.set_with_position_ids(true);
  v1::Shift* shift = request.add_shifts();
  shift->set_input(1);
  shift->set_fill(-100);
  v1::PackResponse gpu_reply, host_reply;
  {
    grpc::ClientContext context;
    const DeviceCounts before = Now();
    ASSERT_TRUE(stub_->Pack(&context, request, &gpu_reply).ok());
    const DeviceCounts cost = Now() - before;
    std::printf("a Pack with documents, pad 8, a shift: %s\n",
                Describe(cost).c_str());
    EXPECT_LE(cost.synchronizations, 3) << Describe(cost);
  }
  // The same bytes as the host's Pack of the same tensors.
  v1::PackRequest host_request;
  *host_request.mutable_mask() = ToProto(mask);
  *host_request.add_inputs() = ToProto(x);
  *host_request.add_inputs() = ToProto(ids);
  *host_request.mutable_segment_ids() = ToProto(segments);
  host_request.set_pad_multiple(8);
  host_request.set_with_position_ids(true);
  *host_request.add_shifts() = *shift;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->Pack(&context, host_request, &host_reply).ok());
  EXPECT_EQ(gpu_reply.SerializeAsString(), host_reply.SerializeAsString());
  ASSERT_TRUE(Unregister("batch").ok());
}

}  // namespace
}  // namespace packd
