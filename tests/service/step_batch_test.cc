// StepBatch (service/step_batch.h) on its own, on fresh random batches: rows
// gathered in plan order (in host memory up to each row's extent, on the
// fake GPU whole rows), the [B, S] tensors brought to the host from the
// device, tensors off the step's device and a loss mask of another shape
// refused by name, and outputs that overlap the batch refused.
#include "service/step_batch.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "client/shm_mapping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/e2e/proto_util.h"
#include "tests/kernels/test_util.h"
#include "tests/service/device_tensors.h"

namespace packd {
namespace {

using testing::Bits;
using testing::FromDevice;
using ::testing::HasSubstr;
using testing::kGpu;
using testing::OnDevice;
using testing::Rng;

// A batch: a holed mask, hidden states, token ids and segment ids.
struct Batch {
  at::Tensor mask, hidden, tokens, ids;
  static Batch Random(Rng& rng, int64_t B, int64_t S) {
    Batch b;
    b.mask =
        testing::RandomMask(rng, DType::kBool, B, S, 0.5, MaskPattern::kHoles);
    b.hidden = testing::RandomTensor(rng, DType::kBFloat16, {B, S, 3});
    b.tokens = testing::RandomTensor(rng, DType::kInt64, {B, S});
    b.ids = testing::RandomTensor(rng, DType::kInt32, {B, S});
    return b;
  }
  // Decoded as the server decodes it: every tensor where `place` puts it.
  DecodedCall Call(
      const Device& device,
      const std::function<TensorView(const at::Tensor&)>& place) const {
    DecodedCall call;
    call.device = device;
    call.mask = place(mask);
    call.tensors = {place(hidden), place(tokens)};
    call.segment_ids = place(ids);
    return call;
  }
};

// Rows picked at random, in a random order, some repeated.
std::vector<int64_t> RandomRows(Rng& rng, int64_t B) {
  std::vector<int64_t> rows(1 + rng.Next() % (2 * B));
  for (int64_t& r : rows) r = static_cast<int64_t>(rng.Next() % B);
  return rows;
}

at::Tensor Index(const at::Tensor& t, const std::vector<int64_t>& rows) {
  return t.index_select(0, at::tensor(rows, at::kLong));
}

at::Tensor HostView(const TensorView& v, const at::Tensor& like) {
  EXPECT_EQ(v.device.kind, DeviceKind::kCpu);
  return at::from_blob(v.data, v.shape, like.options());
}

TEST(StepBatch, GathersRowsInPlanOrderUpToEachRowsExtent) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 1 + rng.Next() % 6, S = 1 + rng.Next() % 24;
    const Batch batch = Batch::Random(rng, B, S);
    absl::StatusOr<std::unique_ptr<StepBatch>> step =
        StepBatch::Of(batch.Call(Device::Cpu(),
                                 [](const at::Tensor& t) { return AsView(t); }),
                      std::nullopt);
    ASSERT_TRUE(step.ok()) << step.status();
    // Each row's extent: one past its last active position.
    std::vector<int64_t> extents(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s < S; ++s) {
        if (batch.mask[b][s].item<bool>()) extents[b] = s + 1;
      }
    }
    const std::vector<int64_t> rows = RandomRows(rng, B);
    absl::StatusOr<GatheredRows> got = (*step)->GatherRows(rows, &extents);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(Bits(HostView(got->mask, batch.mask))
                    .equal(Bits(Index(batch.mask, rows))));
    ASSERT_TRUE(got->segment_ids.has_value());
    EXPECT_TRUE(
        HostView(*got->segment_ids, batch.ids).equal(Index(batch.ids, rows)));
    ASSERT_EQ(got->inputs.size(), 2u);
    const at::Tensor hidden = HostView(got->inputs[0], batch.hidden);
    const at::Tensor tokens = HostView(got->inputs[1], batch.tokens);
    for (size_t j = 0; j < rows.size(); ++j) {
      const int64_t n = extents[rows[j]];
      EXPECT_TRUE(Bits(hidden[j].slice(0, 0, n))
                      .equal(Bits(batch.hidden[rows[j]].slice(0, 0, n))))
          << "trial " << trial << " row " << j;
      EXPECT_TRUE(
          tokens[j].slice(0, 0, n).equal(batch.tokens[rows[j]].slice(0, 0, n)));
    }
    // The mask and ids only.
    got = (*step)->GatherMasks(rows);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->inputs.empty());
    EXPECT_TRUE(Bits(HostView(got->mask, batch.mask))
                    .equal(Bits(Index(batch.mask, rows))));
    ASSERT_TRUE(got->segment_ids.has_value());
    EXPECT_TRUE(
        HostView(*got->segment_ids, batch.ids).equal(Index(batch.ids, rows)));
  }
}

TEST(StepBatch, BringsItsPlanTensorsToTheHostAndGathersInputsOnTheDevice) {
  Rng rng = Rng::Fresh();
  const int64_t B = 5, S = 19;
  const Batch batch = Batch::Random(rng, B, S);
  const at::Tensor loss =
      testing::RandomMask(rng, DType::kUInt8, B, S, 0.7, MaskPattern::kHoles);
  std::vector<Buffer> held;
  auto on_gpu = [&](const at::Tensor& t) { return OnDevice(t, kGpu, &held); };
  absl::StatusOr<std::unique_ptr<StepBatch>> step =
      StepBatch::Of(batch.Call(kGpu, on_gpu), on_gpu(loss));
  ASSERT_TRUE(step.ok()) << step.status();
  const StepBatch& b = **step;
  EXPECT_EQ(b.device(), kGpu);
  EXPECT_EQ(b.call().mask.device, kGpu);
  EXPECT_TRUE(Bits(HostView(b.mask(), batch.mask)).equal(Bits(batch.mask)));
  ASSERT_TRUE(b.segment_ids().has_value());
  EXPECT_TRUE(HostView(*b.segment_ids(), batch.ids).equal(batch.ids));
  ASSERT_TRUE(b.loss_mask().has_value());
  EXPECT_TRUE(HostView(*b.loss_mask(), loss).equal(loss));
  absl::StatusOr<TensorView> tokens = (*step)->OnHost(b.call().tensors[1]);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_TRUE(HostView(*tokens, batch.tokens).equal(batch.tokens));

  // Inputs gathered on their device, whole rows; the mask and ids from the
  // host copies.
  const std::vector<int64_t> rows = {4, 0, 0, 2};
  absl::StatusOr<GatheredRows> got = b.GatherRows(rows, nullptr);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(Bits(HostView(got->mask, batch.mask))
                  .equal(Bits(Index(batch.mask, rows))));
  ASSERT_EQ(got->inputs.size(), 2u);
  EXPECT_EQ(got->inputs[0].device, kGpu);
  EXPECT_TRUE(
      Bits(FromDevice(got->inputs[0].data, kGpu, batch.hidden, {4, S, 3}))
          .equal(Bits(Index(batch.hidden, rows))));
  EXPECT_TRUE(FromDevice(got->inputs[1].data, kGpu, batch.tokens, {4, S})
                  .equal(Index(batch.tokens, rows)));
}

TEST(StepBatch, RefusesTensorsOffTheStepsDeviceAndALossMaskOfAnotherShape) {
  Rng rng = Rng::Fresh();
  const Batch batch = Batch::Random(rng, 3, 8);
  std::vector<Buffer> held;
  DecodedCall call = batch.Call(
      kGpu, [&](const at::Tensor& t) { return OnDevice(t, kGpu, &held); });
  call.tensors[1].device = Device{DeviceKind::kCuda, 1};
  absl::StatusOr<std::unique_ptr<StepBatch>> step =
      StepBatch::Of(std::move(call), std::nullopt);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(step.status().message()),
              HasSubstr("batch.inputs[1] is in a region on cuda:1 but the "
                        "step runs on cuda:0"));

  const at::Tensor loss = at::ones({3, 7}, at::kBool);
  step = StepBatch::Of(
      batch.Call(Device::Cpu(), [](const at::Tensor& t) { return AsView(t); }),
      AsView(loss));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(step.status().message()),
              HasSubstr("loss_mask.shape [3, 7] must equal the batch's mask "
                        "shape [3, 8]"));
}

TEST(StepBatch, ResolvesOutputsThatOverlapNoneOfItsTensors) {
  RegionOptions options;
  options.enabled = true;
  options.key_prefix = "/packd_step_batch_test";
  RegionRegistry regions(options);
  const RequestDecoder decoder(regions, Device::Cpu(), int64_t{64} << 20);
  absl::StatusOr<std::unique_ptr<ShmMapping>> seg = ShmMapping::Create(
      ShmMapping::UniqueKey("/packd_step_batch_test"), 1 << 16);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(
      regions.RegisterSystem(Tenant{}, "batch", (*seg)->key(), 0, 1 << 16)
          .ok());
  Rng rng = Rng::Fresh();
  const Batch batch = Batch::Random(rng, 2, 16);
  std::memcpy((*seg)->data() + 4096, batch.hidden.data_ptr(),
              batch.hidden.nbytes());
  v1::PackMicroBatchesRequest request;
  *request.mutable_batch()->mutable_mask() = testing::ToProto(batch.mask);
  *request.mutable_batch()->add_inputs() =
      testing::InRegion(batch.hidden, "batch", 4096);
  const std::string bytes = request.SerializeAsString();
  Wire<v1::PackMicroBatchesRequest> wire;
  ASSERT_TRUE(wire.Parse(std::vector<absl::string_view>{bytes}).ok());
  const CallSpec spec =
      CallSpec::Of(request.batch(), "batch.", int64_t{64} << 20, Tenant{});
  absl::StatusOr<std::unique_ptr<StepBatch>> step =
      StepBatch::Make(wire, decoder, spec);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_TRUE(Bits(at::from_blob((*step)->call().tensors[0].data, {2, 16, 3},
                                 batch.hidden.options()))
                  .equal(Bits(batch.hidden)));

  v1::RegionSlice outputs;
  outputs.set_region("batch");
  outputs.set_offset(0);
  outputs.set_byte_size(4097);  // one byte into batch.inputs[0]
  absl::StatusOr<ResolvedSlice> resolved =
      (*step)->ResolveOutputs(outputs, decoder, Tenant{});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("outputs overlaps batch.inputs[0]"));
  outputs.set_byte_size(4096);
  resolved = (*step)->ResolveOutputs(outputs, decoder, Tenant{});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  // The slice is the server's mapping of the region, from its offset.
  EXPECT_EQ(resolved->data + 4096,
            static_cast<const char*>((*step)->call().tensors[0].data));
}

}  // namespace
}  // namespace packd
