// RequestDecoder (service/request_decoder.h) on its own: inline tensors become
// views of the received bytes however the message was cut into chunks
// (gathered only where a tensor spans chunks, and a Pack's only up to each
// row's last active position), region slices views of the region's memory,
// and every malformed request an error of the right code naming its field.
#include "service/request_decoder.h"

#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/shm_mapping.h"
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

// `message` serialized and cut into chunks of `chunk` bytes (0: one chunk),
// parsed as received slices are.
template <typename M>
Wire<M> Received(const M& message, size_t chunk, std::string* bytes) {
  *bytes = message.SerializeAsString();
  std::vector<absl::string_view> chunks;
  const absl::string_view all(*bytes);
  if (chunk == 0) chunk = all.size() + 1;
  for (size_t at = 0; at < all.size(); at += chunk) {
    chunks.push_back(all.substr(at, chunk));
  }
  Wire<M> wire;
  EXPECT_TRUE(wire.Parse(chunks).ok());
  return wire;
}

bool SameBytes(const TensorView& v, const at::Tensor& t, int64_t from,
               int64_t n) {
  return std::memcmp(static_cast<const char*>(v.data) + from,
                     static_cast<const char*>(t.data_ptr()) + from, n) == 0;
}

class RequestDecoderTest : public ::testing::Test {
 protected:
  RegionRegistry regions_{RegionOptions{}};
  RequestDecoder decoder_{regions_, Device::Cpu(), kLimit};
};

TEST_F(RequestDecoderTest, InlineTensorsAreTheReceivedBytesWhateverTheChunks) {
  Rng rng = Rng::Fresh();
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t B = 1 + rng.Next() % 5, S = 1 + rng.Next() % 30;
    const int64_t H = 1 + rng.Next() % 7;
    const at::Tensor mask =
        testing::RandomMask(rng, DType::kBool, B, S, 0.5, MaskPattern::kHoles);
    const at::Tensor x = testing::RandomTensor(rng, DType::kFloat32, {B, S, H});
    const at::Tensor tok = testing::RandomTensor(rng, DType::kInt64, {B, S});
    v1::PackRequest pack;
    *pack.mutable_mask() = ToProto(mask);
    *pack.add_inputs() = ToProto(x);
    *pack.add_inputs() = ToProto(tok);
    v1::ScatterRequest scatter;
    *scatter.mutable_mask() = ToProto(mask);
    *scatter.add_packed() = ToProto(x);
    // The extent of each row: its last active position, plus one.
    std::vector<int64_t> extents(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s < S; ++s) {
        if (mask[b][s].item<bool>()) extents[b] = s + 1;
      }
    }
    const size_t chunk = trial % 3 == 0 ? 0 : 1 + rng.Next() % 97;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " chunk " << chunk
                                      << " B " << B << " S " << S);
    std::string bytes;
    const Wire<v1::PackRequest> wire = Received(pack, chunk, &bytes);
    const CallSpec spec = CallSpec::Of(wire.message(), "", kLimit, Tenant{});
    absl::StatusOr<DecodedCall> call = decoder_.Decode(wire, spec);
    ASSERT_TRUE(call.ok()) << call.status();
    EXPECT_EQ(call->device, Device::Cpu());
    EXPECT_TRUE(SameBytes(call->mask, mask, 0, mask.nbytes()));
    ASSERT_EQ(call->tensors.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& t = i == 0 ? x : tok;
      EXPECT_EQ(call->tensors[i].shape, ShapeOf(t));
      const int64_t row = t.nbytes() / B, position = row / S;
      for (int64_t b = 0; b < B; ++b) {
        EXPECT_TRUE(
            SameBytes(call->tensors[i], t, b * row, extents[b] * position))
            << "inputs[" << i << "] row " << b;
      }
    }
    // In one chunk, a tensor of bytes (the mask) is a view of the received
    // bytes: never copied.
    if (chunk == 0) {
      const char* at = static_cast<const char*>(call->mask.data);
      EXPECT_TRUE(at >= bytes.data() && at < bytes.data() + bytes.size());
    }

    const Wire<v1::ScatterRequest> scatter_wire =
        Received(scatter, chunk, &bytes);
    absl::StatusOr<DecodedCall> scattered = decoder_.Decode(
        scatter_wire,
        CallSpec::Of(scatter_wire.message(), "", kLimit, Tenant{}));
    ASSERT_TRUE(scattered.ok()) << scattered.status();
    EXPECT_TRUE(SameBytes(scattered->tensors[0], x, 0, x.nbytes()));
  }
}

// Each malformed request: its code, its field, and the decoder unchanged for
// the next (a good request after it decodes).
TEST_F(RequestDecoderTest, MalformedRequestsAreRefusedNamingTheirField) {
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 3, 8, 0.5, MaskPattern::kPrefix);
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {3, 8, 4});
  v1::PackRequest good;
  *good.mutable_mask() = ToProto(mask);
  *good.add_inputs() = ToProto(x);
  *good.add_inputs() = ToProto(x);

  struct Case {
    const char* what;
    std::function<void(v1::PackRequest*)> change;
    absl::StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"no mask", [](v1::PackRequest* r) { r->clear_mask(); },
       absl::StatusCode::kInvalidArgument, "mask is missing"},
      {"a bad device", [](v1::PackRequest* r) { r->set_device("tpu:0"); },
       absl::StatusCode::kInvalidArgument, "tpu:0"},
      {"short bytes",
       [](v1::PackRequest* r) {
         r->mutable_inputs(1)->mutable_data()->pop_back();
       },
       absl::StatusCode::kInvalidArgument, "inputs[1].data has 191 bytes"},
      {"a mask of rank 1",
       [&](v1::PackRequest* r) {
         *r->mutable_mask() = ToProto(mask.flatten());
       },
       absl::StatusCode::kInvalidArgument, "must have rank 2"},
      {"outputs of the wrong count",
       [](v1::PackRequest* r) {
         *r->add_outputs() = testing::Slice("out", 0, 8);
       },
       absl::StatusCode::kInvalidArgument, "outputs has 1 slices"},
      {"a region while handles are off",
       [&](v1::PackRequest* r) {
         *r->mutable_inputs(0) = testing::InRegion(x, "batch", 0);
       },
       absl::StatusCode::kFailedPrecondition, "tensor handles are disabled"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PackRequest request = good;
    c.change(&request);
    std::string bytes;
    const Wire<v1::PackRequest> wire = Received(request, 0, &bytes);
    absl::StatusOr<DecodedCall> call = decoder_.Decode(
        wire, CallSpec::Of(wire.message(), "", kLimit, Tenant{}));
    ASSERT_FALSE(call.ok());
    EXPECT_EQ(call.status().code(), c.code) << call.status();
    EXPECT_THAT(std::string(call.status().message()), HasSubstr(c.says));
  }
  std::string bytes;
  const Wire<v1::PackRequest> wire = Received(good, 0, &bytes);
  EXPECT_TRUE(
      decoder_.Decode(wire, CallSpec::Of(wire.message(), "", kLimit, Tenant{}))
          .ok());

  // Inside a step's request, the fields are named after its prefix.
  v1::PackRequest nested = good;
  nested.clear_mask();
  const Wire<v1::PackRequest> nested_wire = Received(nested, 0, &bytes);
  absl::StatusOr<DecodedCall> call = decoder_.Decode(
      nested_wire.message(), nested_wire,
      CallSpec::Of(nested_wire.message(), "batch.", kLimit, Tenant{}));
  EXPECT_THAT(std::string(call.status().message()),
              HasSubstr("batch.mask is missing"));
}

TEST_F(RequestDecoderTest, TheMessageLimitBoundsTheRequestAndTheMasksRows) {
  const RequestDecoder small(regions_, Device::Cpu(), 1000);
  Rng rng = Rng::Fresh();
  // Over the limit in bytes.
  v1::PackRequest big;
  *big.mutable_mask() = ToProto(
      testing::RandomMask(rng, DType::kBool, 4, 64, 0.5, MaskPattern::kHoles));
  *big.add_inputs() =
      ToProto(testing::RandomTensor(rng, DType::kFloat32, {4, 64, 1}));
  std::string bytes;
  const Wire<v1::PackRequest> wire = Received(big, 0, &bytes);
  absl::StatusOr<DecodedCall> call =
      small.Decode(wire, CallSpec::Of(wire.message(), "", 1000, Tenant{}));
  EXPECT_EQ(call.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(call.status().message()),
              HasSubstr("--max_message_bytes"));
  EXPECT_FALSE(small.CheckSize("response", 1001).ok());
  EXPECT_TRUE(small.CheckSize("response", 1000).ok());
  // A mask of more rows than the limit has metadata for, and no bytes.
  v1::PackRequest rows;
  EncodeTensorHeader(DType::kBool, {MaxBatchRows(1000) + 1, 0},
                     rows.mutable_mask());
  const Wire<v1::PackRequest> rows_wire = Received(rows, 0, &bytes);
  call = small.Decode(rows_wire,
                      CallSpec::Of(rows_wire.message(), "", 1000, Tenant{}));
  EXPECT_EQ(call.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(call.status().message()), HasSubstr("rows"));
  EncodeTensorHeader(DType::kBool, {MaxBatchRows(1000), 0},
                     rows.mutable_mask());
  const Wire<v1::PackRequest> fits = Received(rows, 0, &bytes);
  EXPECT_TRUE(
      small.Decode(fits, CallSpec::Of(fits.message(), "", 1000, Tenant{}))
          .ok());
}

TEST(RequestDecoderRegionsTest, ASliceIsAViewOfItsRegionHeldForTheCall) {
  RegionOptions options;
  options.enabled = true;
  options.key_prefix = "/packd_decoder_test";
  RegionRegistry regions(options);
  const RequestDecoder decoder(regions, Device::Cpu(), kLimit);
  absl::StatusOr<std::unique_ptr<ShmMapping>> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_decoder_test"), 1 << 16);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(
      regions.RegisterSystem(Tenant{}, "batch", (*seg)->key(), 0, 1 << 16)
          .ok());
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 2, 16, 0.5, MaskPattern::kHoles);
  const at::Tensor x = testing::RandomTensor(rng, DType::kFloat16, {2, 16, 8});
  std::memcpy((*seg)->data() + 4096, x.data_ptr(), x.nbytes());
  v1::PackRequest request;
  *request.mutable_mask() = ToProto(mask);
  *request.add_inputs() = testing::InRegion(x, "batch", 4096);
  std::string bytes;
  const Wire<v1::PackRequest> wire = Received(request, 0, &bytes);
  const CallSpec spec = CallSpec::Of(wire.message(), "", kLimit, Tenant{});
  absl::StatusOr<DecodedCall> call = decoder.Decode(wire, spec);
  ASSERT_TRUE(call.ok()) << call.status();
  // The server's own mapping of the segment: the bytes written there, and
  // later writes seen through it.
  const at::Tensor seen =
      at::from_blob(call->tensors[0].data, {2, 16, 8}, at::kHalf);
  EXPECT_TRUE(testing::Bits(seen).equal(testing::Bits(x)));
  (*seg)->data()[4096] ^= 0x5a;
  EXPECT_FALSE(testing::Bits(seen).equal(testing::Bits(x)));
  ASSERT_EQ(call->held.size(), 1u);
  EXPECT_EQ(call->held[0]->name(), "batch");

  // A slice of another size than the tensor's: refused, naming it.
  request.mutable_inputs(0)->mutable_region()->set_byte_size(x.nbytes() - 2);
  const Wire<v1::PackRequest> bad = Received(request, 0, &bytes);
  call = decoder.Decode(bad, CallSpec::Of(bad.message(), "", kLimit, Tenant{}));
  EXPECT_EQ(call.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(call.status().message()),
              HasSubstr("inputs[0].region has 510 bytes"));
}

}  // namespace
}  // namespace packd
