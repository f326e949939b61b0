// DevicePass (service/device_pass.h) on its own, on the fake GPU: fresh random
// batches in device memory, planned by hand into micro-batches over two
// ranks, each micro-batch's message from the pass equal, metadata and bytes,
// to the host's Pack of its rows gathered in plan order (which the oracle
// tests hold to torch), asked in any order, with the results read back to the
// host or written into an outputs arena on the device; and when a step takes
// the pass.
#include "service/device_pass.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "proto/tensor_codec.h"
#include "service/pack_reply.h"
#include "tests/e2e/proto_util.h"
#include "tests/kernels/test_util.h"
#include "tests/service/device_tensors.h"

namespace packd {
namespace {

using testing::Bits;
using testing::FromDevice;
using testing::kGpu;
using testing::OnDevice;
using testing::Rng;

constexpr int64_t kLimit = int64_t{64} << 20;

// A batch of prompt-and-completion rows with documents, its layout, and the
// request's headers for it.
struct Batch {
  at::Tensor mask, hidden, tokens, ids;
  LayoutOptions layout;
  v1::PackRequest request;

  static Batch Random(Rng& rng, int64_t B, int64_t S) {
    Batch b;
    b.mask = testing::RandomMask(
        rng, DType::kBool, B, S, 0.6,
        rng.Next() % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix);
    b.hidden = testing::RandomTensor(rng, DType::kBFloat16, {B, S, 5});
    b.tokens = testing::RandomTensor(rng, DType::kInt64, {B, S});
    b.ids = at::zeros({B, S}, at::kInt);
    int* ids = b.ids.data_ptr<int>();
    for (int64_t at = 0, id = 0; at < B * S; ++id) {
      const int64_t n = 1 + static_cast<int64_t>(rng.Next() % 9);
      for (int64_t k = at; k < std::min(at + n, B * S); ++k) {
        ids[k] = static_cast<int>(id);
      }
      at += n;
    }
    b.layout.pad_multiple = 1 + rng.Next() % 8;
    b.layout.shifts = {Shift{1, -100}};
    b.layout.with_seq_idx = rng.Next() % 2 == 0;
    *b.request.mutable_mask() = testing::ToProto(b.mask);
    *b.request.add_inputs() = testing::ToProto(b.hidden);
    *b.request.add_inputs() = testing::ToProto(b.tokens);
    *b.request.mutable_segment_ids() = testing::ToProto(b.ids);
    EncodeLayout(b.layout, &b.request);
    b.request.set_with_position_ids(true);
    return b;
  }
};

// The rows shuffled and cut into micro-batches of 1 to 3 rows, the first
// half rank 0's, the rest rank 1's.
v1::PlanResponse RandomPlan(Rng& rng, int64_t B) {
  std::vector<int64_t> rows(B);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng.engine);
  std::vector<std::vector<int64_t>> cut;
  for (size_t at = 0; at < rows.size();) {
    const size_t n = std::min<size_t>(1 + rng.Next() % 3, rows.size() - at);
    cut.emplace_back(rows.begin() + at, rows.begin() + at + n);
    at += n;
  }
  v1::PlanResponse plan;
  for (size_t k = 0; k < cut.size(); ++k) {
    v1::MicroBatch* mb = plan.add_micro_batches();
    mb->set_rank(k < (cut.size() + 1) / 2 ? 0 : 1);
    for (int64_t r : cut[k]) mb->add_samples(r);
  }
  return plan;
}

// Results into host memory that `held` keeps.
OutputAllocator IntoHost(std::vector<std::vector<char>>* held) {
  return [held](size_t, int64_t bytes) -> absl::StatusOr<OutputPlace> {
    held->emplace_back(std::max<int64_t>(bytes, 1));
    return OutputPlace{held->back().data(), Device::Cpu()};
  };
}

// The host's message for `rows`: Pack of the rows gathered in plan order.
v1::PackResponse HostMessage(const Batch& batch, const CallSpec& spec,
                             const std::vector<int64_t>& rows,
                             std::vector<at::Tensor>* results) {
  const at::Tensor index = at::tensor(rows, at::kLong);
  const at::Tensor mask = batch.mask.index_select(0, index);
  const at::Tensor hidden = batch.hidden.index_select(0, index);
  const at::Tensor tokens = batch.tokens.index_select(0, index);
  const at::Tensor ids = batch.ids.index_select(0, index);
  CallOptions base;
  base.device = Device::Cpu();
  absl::StatusOr<PackResult> r =
      Pack({AsView(hidden), AsView(tokens)}, AsView(mask),
           spec.OfRows(rows, GridsByRow{}).PackOptionsFor(base, AsView(ids)));
  EXPECT_TRUE(r.ok()) << r.status();
  v1::PackResponse response;
  if (!r.ok()) return response;
  for (const ResultTensor& t : r->packed) {
    results->push_back(AsTensor(t.view).clone());
  }
  for (const ResultTensor& t : r->shifted) {
    results->push_back(AsTensor(t.view).clone());
  }
  EncodeResults(SetPackResponse(std::move(*r), &response), {},
                PackSlots(&response, 2));
  return response;
}

struct Step {
  std::vector<Buffer> held;
  CallSpec spec;
  LayoutValues values;
  std::unique_ptr<StepBatch> batch;
  v1::PlanResponse plan;
  MicroBatchTables tables;
};

// `batch` on the fake GPU, planned at random and placed.
void MakeStep(Rng& rng, const Batch& batch, Step* step) {
  step->spec = CallSpec::Of(batch.request, "batch.", kLimit, Tenant{});
  DecodedCall call;
  call.device = kGpu;
  call.mask = OnDevice(batch.mask, kGpu, &step->held);
  call.tensors = {OnDevice(batch.hidden, kGpu, &step->held),
                  OnDevice(batch.tokens, kGpu, &step->held)};
  call.segment_ids = OnDevice(batch.ids, kGpu, &step->held);
  absl::StatusOr<std::unique_ptr<StepBatch>> made =
      StepBatch::Of(std::move(call), std::nullopt);
  ASSERT_TRUE(made.ok()) << made.status();
  step->batch = std::move(*made);
  std::vector<DType> dtypes;
  for (const TensorView& x : step->batch->call().tensors) {
    dtypes.push_back(x.dtype);
  }
  absl::StatusOr<LayoutValues> values = CheckLayout(step->spec.layout, dtypes);
  ASSERT_TRUE(values.ok()) << values.status();
  step->values = std::move(*values);
  PackOptions host;
  host.device = Device::Cpu();
  host.segment_ids = step->batch->segment_ids();
  absl::StatusOr<PackResult> counted =
      Pack({step->batch->mask()}, step->batch->mask(), host);
  ASSERT_TRUE(counted.ok()) << counted.status();
  const MeasuredRows measured = MeasureRows(*counted, std::nullopt, true,
                                            step->spec.sizes, PlanOptions{});
  step->plan = RandomPlan(rng, batch.mask.size(0));
  absl::StatusOr<MicroBatchTables> tables = PlaceMicroBatches(
      step->plan, {}, 2, measured.rows, step->spec.layout, step->spec.sizes,
      step->batch->call().tensors, HostGather{64 * batch.mask.size(1)}, kLimit);
  ASSERT_TRUE(tables.ok()) << tables.status();
  step->tables = std::move(*tables);
}

std::vector<int64_t> Samples(const MicroBatchPlace& place) {
  return {place.micro_batch->samples().begin(),
          place.micro_batch->samples().end()};
}

// Runs the pass over `step`'s micro-batches in `order`, into `outputs` (an
// arena on the device) or read back when null, and expects each message to be
// the host's, metadata and bytes.
void ExpectHostMessages(const Batch& batch, const Step& step, char* outputs,
                        const std::vector<size_t>& order) {
  const std::vector<MicroBatchPlace>& sent = step.tables.sent;
  const DevicePass pass(*step.batch, step.spec, step.values, sent, outputs,
                        step.tables.output_bytes);
  for (size_t k : order) {
    SCOPED_TRACE(::testing::Message() << "micro-batch " << k);
    std::vector<std::vector<char>> held;
    CallOptions base;
    base.device = kGpu;
    base.allocate = IntoHost(&held);
    if (outputs != nullptr) {
      base.allocate = [&](size_t r, int64_t) -> absl::StatusOr<OutputPlace> {
        return OutputPlace{outputs + sent[k].offsets[r], kGpu};
      };
    }
    v1::PackResponse got;
    ASSERT_TRUE(pass.Message(k, &got, base, {}).ok());
    std::vector<at::Tensor> want;
    const v1::PackResponse expected =
        HostMessage(batch, step.spec, Samples(sent[k]), &want);
    EXPECT_EQ(got.SerializeAsString(), expected.SerializeAsString());
    for (size_t r = 0; r < want.size(); ++r) {
      ASSERT_EQ(want[r].nbytes(), static_cast<size_t>(sent[k].bytes[r]));
      const at::Tensor read =
          outputs != nullptr ? FromDevice(outputs + sent[k].offsets[r], kGpu,
                                          want[r], want[r].sizes().vec())
                             : at::from_blob(held[r].data(), want[r].sizes(),
                                             want[r].options());
      EXPECT_TRUE(Bits(read).equal(Bits(want[r]))) << "result " << r;
    }
  }
  EXPECT_GT(pass.time(), absl::ZeroDuration());
}

TEST(DevicePass, EachMessageIsTheHostsPackOfItsRowsReadBack) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    const Batch batch =
        Batch::Random(rng, 1 + rng.Next() % 9, 1 + rng.Next() % 40);
    Step step;
    ASSERT_NO_FATAL_FAILURE(MakeStep(rng, batch, &step));
    EXPECT_TRUE(DevicePass::Applies(*step.batch, step.spec, nullptr,
                                    step.tables.output_bytes));
    // Asked in a random order: each wave runs once, whichever asks first.
    std::vector<size_t> order(step.tables.sent.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    ExpectHostMessages(batch, step, nullptr, order);
  }
}

TEST(DevicePass, WritesEachMicroBatchIntoItsPlaceInTheOutputs) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 6; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    const Batch batch =
        Batch::Random(rng, 2 + rng.Next() % 7, 4 + rng.Next() % 30);
    Step step;
    ASSERT_NO_FATAL_FAILURE(MakeStep(rng, batch, &step));
    std::vector<Buffer> arena;
    const at::Tensor zeros =
        at::zeros({std::max<int64_t>(step.tables.output_bytes, 1)}, at::kByte);
    char* outputs = static_cast<char*>(OnDevice(zeros, kGpu, &arena).data);
    std::vector<size_t> order(step.tables.sent.size());
    std::iota(order.begin(), order.end(), 0);
    ExpectHostMessages(batch, step, outputs, order);
  }
}

TEST(DevicePass, AppliesToABatchWhollyOnItsGpuWithinTheInlineBound) {
  Rng rng = Rng::Fresh();
  const Batch batch = Batch::Random(rng, 4, 16);
  Step step;
  ASSERT_NO_FATAL_FAILURE(MakeStep(rng, batch, &step));
  EXPECT_TRUE(DevicePass::Applies(*step.batch, step.spec, nullptr,
                                  DevicePass::kInlineBytes));
  // Inline results past the bound: a micro-batch at a time instead.
  EXPECT_FALSE(DevicePass::Applies(*step.batch, step.spec, nullptr,
                                   DevicePass::kInlineBytes + 1));
  // An input in host memory: packed on the host.
  DecodedCall call;
  call.device = kGpu;
  call.mask = AsView(batch.mask);
  call.tensors = {step.batch->call().tensors[0], AsView(batch.tokens)};
  absl::StatusOr<std::unique_ptr<StepBatch>> mixed =
      StepBatch::Of(std::move(call), std::nullopt);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_FALSE(DevicePass::Applies(**mixed, step.spec, nullptr, 0));
  // A batch in host memory.
  DecodedCall host;
  host.device = Device::Cpu();
  host.mask = AsView(batch.mask);
  host.tensors = {AsView(batch.hidden), AsView(batch.tokens)};
  absl::StatusOr<std::unique_ptr<StepBatch>> on_host =
      StepBatch::Of(std::move(host), std::nullopt);
  ASSERT_TRUE(on_host.ok()) << on_host.status();
  EXPECT_FALSE(DevicePass::Applies(**on_host, step.spec, nullptr, 0));
}

}  // namespace
}  // namespace packd
