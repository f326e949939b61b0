// CallSpec (service/call_spec.h) on its own: the headers, layout and sizes of
// fresh random requests as the request states them; the result bytes
// admission holds bound (and without padding equal) what the op returns for
// the options the spec makes; an invalid header's error kept, naming its
// field; a micro-batch's spec of its rows.
#include "service/call_spec.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/e2e/proto_util.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using testing::Rng;
using testing::ShapeOf;
using testing::ToProto;

constexpr int64_t kLimit = 64 << 20;

int64_t Bytes(const std::vector<ResultTensor>& results) {
  int64_t bytes = 0;
  for (const ResultTensor& t : results) bytes += t.view.nbytes();
  return bytes;
}

TEST(CallSpecTest, APacksSpecIsItsRequestAndBoundsItsResults) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t B = 1 + rng.Next() % 6, S = 1 + rng.Next() % 32;
    const bool docs = trial % 2 == 1;
    const at::Tensor mask = testing::RandomMask(
        rng, DType::kBool, B, S, rng.Uniform(), MaskPattern::kHoles);
    const at::Tensor x = testing::RandomTensor(
        rng, trial % 3 ? DType::kBFloat16 : DType::kFloat64,
        {B, S, 1 + static_cast<int64_t>(rng.Next() % 6)});
    const at::Tensor tok = testing::RandomTensor(rng, DType::kInt32, {B, S});
    at::Tensor ids = at::empty({B, S}, at::kInt);
    for (int64_t i = 0; i < B * S; ++i) {
      ids.data_ptr<int32_t>()[i] = static_cast<int32_t>(rng.Next() % 3);
    }
    LayoutOptions layout;
    layout.pad_multiple = trial % 4 == 0 ? 1 : 1 + rng.Next() % 8;
    if (trial % 3 == 1) layout.shifts = {{1, -100}};
    layout.with_seq_idx = rng.Next() % 2 == 0;
    v1::PackRequest request;
    *request.mutable_mask() = ToProto(mask);
    *request.add_inputs() = ToProto(x);
    *request.add_inputs() = ToProto(tok);
    if (docs) *request.mutable_segment_ids() = ToProto(ids);
    EncodeLayout(layout, &request);
    request.set_with_position_ids(rng.Next() % 2 == 0);
    request.set_with_token_mask(rng.Next() % 2 == 0);
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " pad " << layout.pad_multiple);

    const CallSpec spec = CallSpec::Of(request, "", kLimit, Tenant{});
    EXPECT_EQ(spec.op, CallSpec::Op::kPack);
    EXPECT_STREQ(spec.method(), "Pack");
    ASSERT_TRUE(spec.mask.ok());
    EXPECT_EQ(spec.mask->shape, ShapeOf(mask));
    ASSERT_EQ(spec.tensors.size(), 2u);
    EXPECT_EQ(spec.tensors[0]->shape, ShapeOf(x));
    EXPECT_EQ(spec.tensors[1]->dtype, DType::kInt32);
    EXPECT_EQ(spec.segment_ids.has_value(), docs);
    EXPECT_EQ(spec.results, 2 + static_cast<int>(layout.shifts.size()));
    EXPECT_EQ(spec.layout.pad_multiple, layout.pad_multiple);
    EXPECT_EQ(spec.layout.shifts.size(), layout.shifts.size());
    EXPECT_EQ(spec.layout.max_rows, MaxEntriesPerMessage(kLimit));
    EXPECT_FALSE(spec.to_outputs);
    const std::vector<TensorView> inputs = {AsView(x), AsView(tok)};
    const PackSizes sizes =
        PackSizes::Of(inputs, layout,
                      {request.with_position_ids(), request.with_token_mask()});
    EXPECT_EQ(spec.sizes.row_bytes, sizes.row_bytes);
    EXPECT_EQ(spec.sizes.input_bytes, sizes.input_bytes);
    EXPECT_EQ(spec.sizes.metadata_bytes_per_row, sizes.metadata_bytes_per_row);

    // The op on the spec's options: what admission held bounds its results.
    std::optional<TensorView> segment_ids;
    if (docs) segment_ids = AsView(ids);
    const PackOptions options = spec.PackOptionsFor(CallOptions{}, segment_ids);
    EXPECT_EQ(options.with_position_ids, request.with_position_ids());
    EXPECT_EQ(options.with_token_mask, request.with_token_mask());
    absl::StatusOr<PackResult> r = Pack(inputs, AsView(mask), options);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->total_active > 0) {
      EXPECT_EQ(r->position_ids.empty(), !request.with_position_ids());
      EXPECT_EQ(r->doc_row.empty(), !docs);
    }
    const int64_t results = Bytes(r->packed) + Bytes(r->shifted);
    EXPECT_LE(results, spec.ResultBytes(r->total_active));
    if (layout.pad_multiple == 1) {
      EXPECT_EQ(results, spec.ResultBytes(r->total_active));
    }
    // The mask not inline: the inputs' whole size bounds them.
    EXPECT_EQ(spec.ResultBytes(-1), sizes.input_bytes);
    EXPECT_EQ(spec.ReservedBytes(B), BatchMetadataBytes(B));
  }
}

TEST(CallSpecTest, AScattersResultBytesAreEveryPositionOfEachTensor) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t B = 1 + rng.Next() % 5, S = 1 + rng.Next() % 20;
    at::Tensor mask =
        testing::RandomMask(rng, DType::kBool, B, S, 0.5, MaskPattern::kHoles);
    // An empty mask too: no packed rows, every position zeroed.
    if (trial == 0) mask = at::zeros_like(mask);
    const int64_t n = mask.sum().item<int64_t>();
    const at::Tensor g = testing::RandomTensor(rng, DType::kFloat32, {n, 3});
    const at::Tensor h = testing::RandomTensor(rng, DType::kInt16, {n});
    v1::ScatterRequest request;
    *request.mutable_mask() = ToProto(mask);
    *request.add_packed() = ToProto(g);
    *request.add_packed() = ToProto(h);
    const CallSpec spec = CallSpec::Of(request, "", kLimit, Tenant{});
    EXPECT_STREQ(spec.method(), "Scatter");
    EXPECT_EQ(spec.results, 2);
    EXPECT_EQ(spec.ReservedBytes(B), 0);
    absl::StatusOr<ScatterResult> r =
        Scatter({AsView(g), AsView(h)}, AsView(mask),
                spec.ScatterOptionsFor(CallOptions{}, std::nullopt));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(spec.ResultBytes(n), Bytes(r->dense));
    EXPECT_EQ(spec.ResultBytes(n), B * S * (3 * 4 + 2));
  }
}

TEST(CallSpecTest, AnInvalidHeaderKeepsItsErrorNamingItsField) {
  Rng rng = Rng::Fresh();
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat32, {2, 4, 3});
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(at::ones({2, 4}, at::kBool));
  *request.add_inputs() = ToProto(x);
  v1::Tensor* bad = request.add_inputs();
  *bad = ToProto(x);
  bad->set_shape(1, -4);
  const CallSpec spec = CallSpec::Of(request, "batch.", kLimit, Tenant{});
  EXPECT_TRUE(spec.tensors[0].ok());
  ASSERT_FALSE(spec.tensors[1].ok());
  EXPECT_EQ(spec.tensors[1].status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.tensors[1].status().message()),
              HasSubstr("batch.inputs[1]"));
  // Sized as if it were empty.
  EXPECT_EQ(spec.sizes.input_bytes, x.nbytes());
  // Results to outputs: nothing inline to hold.
  *request.add_outputs() = testing::Slice("out", 0, 8);
  EXPECT_EQ(CallSpec::Of(request, "", kLimit, Tenant{}).ResultBytes(8), 0);
}

TEST(CallSpecTest, OfRowsIsTheSpecOfThoseRowsAsABatch) {
  v1::PackRequest request;
  EncodeTensorHeader(DType::kBool, {6, 10}, request.mutable_mask());
  EncodeTensorHeader(DType::kFloat16, {6, 10, 4}, request.add_inputs());
  EncodeTensorHeader(DType::kInt32, {6, 10}, request.mutable_segment_ids());
  LayoutOptions layout;
  layout.shared_prefix =
      SharedPrefix{{0, 0, 1, 1, 2, 2}, {3, 3, 2, 2, 5, 5}, {0}};
  EncodeLayout(layout, &request);
  const CallSpec spec = CallSpec::Of(request, "", kLimit, Tenant{});
  const std::vector<int64_t> rows = {4, 1, 5};
  const CallSpec part = spec.OfRows(rows, GridsByRow{});
  EXPECT_EQ(part.mask->shape, (Shape{3, 10}));
  EXPECT_EQ(part.tensors[0]->shape, (Shape{3, 10, 4}));
  EXPECT_EQ((*part.segment_ids)->shape, (Shape{3, 10}));
  ASSERT_TRUE(part.layout.shared_prefix.has_value());
  EXPECT_EQ(part.layout.shared_prefix->groups, (std::vector<int64_t>{2, 0, 2}));
  EXPECT_EQ(part.layout.shared_prefix->prefix_lengths,
            (std::vector<int64_t>{5, 3, 5}));
  EXPECT_EQ(part.layout.shared_prefix->same_inputs,
            spec.layout.shared_prefix->same_inputs);
  // The batch's spec is unchanged.
  EXPECT_EQ(spec.mask->shape, (Shape{6, 10}));
}

}  // namespace
}  // namespace packd
