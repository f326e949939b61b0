// The tensor-aware wire parser and writer (proto/wire.h) against protobuf
// itself: whatever protobuf parses, ParseWithPayloads parses to the same
// message from any split of the bytes into chunks; whatever protobuf refuses,
// it refuses with INVALID_ARGUMENT saying where.
#include "proto/wire.h"

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "proto/grpc_wire.h"

namespace packd {
namespace {

using google::protobuf::util::MessageDifferencer;
using ::testing::HasSubstr;

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

v1::PackRequest SampleRequest(std::mt19937_64& rng) {
  v1::PackRequest r;
  r.set_device("cpu");
  r.set_with_position_ids(true);
  r.mutable_mask()->set_dtype(v1::DTYPE_BOOL);
  r.mutable_mask()->add_shape(2);
  r.mutable_mask()->add_shape(3);
  r.mutable_mask()->set_data(RandomBytes(rng, 6));
  for (int i = 0; i < 3; ++i) {
    v1::Tensor* t = r.add_inputs();
    t->set_dtype(v1::DTYPE_BFLOAT16);
    t->add_shape(2);
    t->add_shape(3);
    t->add_shape(i + 1);
    t->set_data(RandomBytes(rng, 12 * (i + 1)));
  }
  v1::Tensor* handle = r.add_inputs();
  handle->set_dtype(v1::DTYPE_INT8);
  handle->add_shape(2);
  handle->add_shape(3);
  handle->mutable_region()->set_region("seg");
  handle->mutable_region()->set_offset(64);
  handle->mutable_region()->set_byte_size(6);
  r.mutable_segment_ids()->set_dtype(v1::DTYPE_INT32);
  r.mutable_segment_ids()->set_data(RandomBytes(rng, 24));
  r.add_outputs()->set_region("out");
  return r;
}

// Copies every payload of `from` and its message fields back into the
// matching tensor's data in `to` (a copy of `from`).
void CopyBackPayloads(const google::protobuf::Message& from,
                      google::protobuf::Message* to, const Payloads& payloads) {
  const auto* reflection = from.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(from, &fields);
  for (const auto* field : fields) {
    if (field->message_type() == nullptr) continue;
    const int n = field->is_repeated() ? reflection->FieldSize(from, field) : 1;
    for (int i = 0; i < n; ++i) {
      const auto& sub = field->is_repeated()
                            ? reflection->GetRepeatedMessage(from, field, i)
                            : reflection->GetMessage(from, field);
      auto* to_sub = field->is_repeated()
                         ? reflection->MutableRepeatedMessage(to, field, i)
                         : reflection->MutableMessage(to, field);
      if (field->message_type() != v1::Tensor::descriptor()) {
        CopyBackPayloads(sub, to_sub, payloads);
        continue;
      }
      auto it = payloads.find(static_cast<const v1::Tensor*>(&sub));
      if (it == payloads.end()) continue;
      std::string bytes(it->second.size, '\0');
      it->second.CopyOut(0, it->second.size, bytes.data());
      static_cast<v1::Tensor*>(to_sub)->set_data(bytes);
    }
  }
}

// The message with every payload copied back into its tensor's data.
template <typename M>
M Materialized(const M& parsed, const Payloads& payloads) {
  M out = parsed;
  CopyBackPayloads(parsed, &out, payloads);
  return out;
}

// Parses `bytes` split into chunks at `cuts` (sorted offsets).
template <typename M>
absl::Status ParseSplit(const std::string& bytes, std::vector<size_t> cuts,
                        M* out, Payloads* payloads) {
  static std::vector<absl::string_view> chunks;
  chunks.clear();
  size_t from = 0;
  cuts.push_back(bytes.size());
  for (size_t cut : cuts) {
    chunks.push_back(absl::string_view(bytes).substr(from, cut - from));
    from = cut;
  }
  return ParseWithPayloads(chunks, M::descriptor()->name(), out, payloads);
}

// Ours agrees with protobuf on `bytes`, for these cuts.
template <typename M>
void ExpectAgrees(const std::string& bytes, const std::vector<size_t>& cuts) {
  M expected;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  M parsed;
  Payloads payloads;
  const absl::Status status = ParseSplit(bytes, cuts, &parsed, &payloads);
  ASSERT_EQ(status.ok(), protobuf_ok)
      << status << " for " << bytes.size() << " bytes";
  if (!status.ok()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(" at byte "));
    return;
  }
  EXPECT_TRUE(
      MessageDifferencer::Equals(Materialized(parsed, payloads), expected))
      << Materialized(parsed, payloads).DebugString() << "\nvs\n"
      << expected.DebugString();
}

TEST(WireTest, EveryTwoChunkSplitParsesLikeProtobuf) {
  std::mt19937_64 rng(1);
  const std::string bytes = SampleRequest(rng).SerializeAsString();
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    ExpectAgrees<v1::PackRequest>(bytes, {cut});
  }
}

TEST(WireTest, OneByteChunksParseLikeProtobuf) {
  std::mt19937_64 rng(2);
  const std::string bytes = SampleRequest(rng).SerializeAsString();
  std::vector<size_t> cuts;
  for (size_t i = 1; i < bytes.size(); ++i) cuts.push_back(i);
  ExpectAgrees<v1::PackRequest>(bytes, cuts);
}

TEST(WireTest, InlineBytesStayInPlace) {
  std::mt19937_64 rng(3);
  const std::string bytes = SampleRequest(rng).SerializeAsString();
  v1::PackRequest parsed;
  Payloads payloads;
  ASSERT_TRUE(ParseSplit(bytes, {}, &parsed, &payloads).ok());
  ASSERT_EQ(payloads.size(), 5u);  // mask, three inline inputs, segment_ids
  const Payload& input = payloads.at(&parsed.inputs(2));
  ASSERT_TRUE(input.contiguous());
  EXPECT_GE(input.data(), bytes.data());
  EXPECT_LT(input.data(), bytes.data() + bytes.size());
  EXPECT_TRUE(parsed.inputs(2).data().empty());
  EXPECT_EQ(payloads.count(&parsed.inputs(3)), 0u);  // the handle
  EXPECT_EQ(parsed.inputs(3).region().region(), "seg");
}

TEST(WireTest, EveryTruncationParsesLikeProtobuf) {
  std::mt19937_64 rng(4);
  const std::string bytes = SampleRequest(rng).SerializeAsString();
  for (size_t n = 0; n < bytes.size(); ++n) {
    ExpectAgrees<v1::PackRequest>(bytes.substr(0, n), {n / 2});
  }
}

TEST(WireTest, LengthPastTheEndSaysWhere) {
  // inputs: tag 0x12, length 100, then only 3 bytes.
  const std::string bytes("\x12\x64\x08\x01\x10", 5);
  v1::PackRequest parsed;
  Payloads payloads;
  const absl::Status status = ParseSplit(bytes, {2}, &parsed, &payloads);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("inputs"));
  EXPECT_THAT(status.message(), HasSubstr("at byte 1"));
  EXPECT_THAT(status.message(), HasSubstr("runs past the end"));
  // The same inside a tensor: data of length 2^40.
  const std::string inner("\x0a\x07\x1a\x80\x80\x80\x80\x80\x20", 9);
  EXPECT_THAT(ParseSplit(inner, {4}, &parsed, &payloads).message(),
              HasSubstr("mask.data at byte 3"));
}

TEST(WireTest, BadTagsAndVarintsAreRefused) {
  v1::PackRequest parsed;
  Payloads payloads;
  for (const std::string& bytes :
       {std::string("\x00\x01", 2), std::string("\x0f\x01", 2),
        std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),
        std::string("\x28\x80", 2), std::string("\x0c", 1)}) {
    const absl::Status status = ParseSplit(bytes, {1}, &parsed, &payloads);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    v1::PackRequest expected;
    EXPECT_FALSE(expected.ParseFromString(bytes));
  }
}

TEST(WireTest, UnknownFieldsAndAnyOrderParseLikeProtobuf) {
  std::mt19937_64 rng(5);
  // Unknown fields of every wire type at the top level and inside a tensor,
  // inputs interleaved with other fields, the mask given twice (merged), and
  // a tensor whose region comes after its data (the region wins) and one whose
  // data comes after its region (the data wins).
  const std::string unknown =
      std::string("\xc8\x06\x05", 3) +                    // 100: varint
      std::string("\xc9\x06", 2) + RandomBytes(rng, 8) +  // 100: fixed64
      std::string("\xcd\x06", 2) + RandomBytes(rng, 4) +  // 100: fixed32
      std::string("\xca\x06\x02xy", 5) +                  // 100: bytes
      std::string("\xcb\x06\x08\x01\xcc\x06", 6);         // 100: group
  v1::Tensor a;
  a.set_dtype(v1::DTYPE_INT8);
  a.add_shape(4);
  a.set_data("abcd");
  v1::Tensor region_last = a;
  region_last.mutable_region()->set_region("r");
  const std::string region_then_data =
      region_last.SerializeAsString() + a.SerializeAsString();
  auto field = [](int number, const std::string& value) {
    std::string out;
    out.push_back(static_cast<char>((number << 3) | 2));
    out.push_back(static_cast<char>(value.size()));
    return out + value;
  };
  const std::string a_bytes = a.SerializeAsString();
  const std::string bytes =
      unknown + field(2, a_bytes + unknown) + field(3, "cpu") +
      field(1, a_bytes) +
      field(2, a.SerializeAsString() + "\x22\x03\x0a\x01r") +
      field(2, region_then_data) + "\x28\x01" + field(1, "\x10\x07") +
      field(2, "") + unknown;
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    ExpectAgrees<v1::PackRequest>(bytes, {cut});
  }
  v1::PackRequest parsed;
  Payloads payloads;
  ASSERT_TRUE(ParseSplit(bytes, {}, &parsed, &payloads).ok());
  ASSERT_EQ(parsed.inputs_size(), 4);
  EXPECT_EQ(payloads.count(&parsed.inputs(1)), 0u);  // region last
  EXPECT_TRUE(parsed.inputs(1).has_region());
  EXPECT_EQ(payloads.count(&parsed.inputs(2)), 1u);  // data last
  EXPECT_FALSE(parsed.inputs(2).has_region());
}

TEST(WireTest, RandomCorruptionParsesLikeProtobuf) {
  std::mt19937_64 rng(6);
  for (int round = 0; round < 3000; ++round) {
    std::string bytes = SampleRequest(rng).SerializeAsString();
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng());
    }
    ExpectAgrees<v1::PackRequest>(bytes, {rng() % (bytes.size() + 1)});
    ExpectAgrees<v1::ScatterRequest>(bytes, {rng() % (bytes.size() + 1)});
  }
}

// A step's messages hold tensors one level down (batch.inputs, packed.packed):
// those carry their bytes in place too, from any split, and write back as
// protobuf does.
TEST(WireTest, NestedTensorsStayInPlace) {
  std::mt19937_64 rng(13);
  v1::PackMicroBatchesRequest step;
  *step.mutable_batch() = SampleRequest(rng);
  step.mutable_plan()->set_max_tokens_per_micro_batch(64);
  step.mutable_loss_mask()->set_dtype(v1::DTYPE_BOOL);
  step.mutable_loss_mask()->set_data(RandomBytes(rng, 6));
  step.add_ranks(1);
  const std::string bytes = step.SerializeAsString();
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    ExpectAgrees<v1::PackMicroBatchesRequest>(bytes, {cut});
  }
  v1::PackMicroBatchesRequest parsed;
  Payloads payloads;
  ASSERT_TRUE(ParseSplit(bytes, {}, &parsed, &payloads).ok());
  EXPECT_EQ(payloads.size(), 6u);  // the batch's five, and loss_mask
  const Payload& input = payloads.at(&parsed.batch().inputs(2));
  EXPECT_GE(input.data(), bytes.data());
  EXPECT_LT(input.data(), bytes.data() + bytes.size());
  EXPECT_TRUE(parsed.batch().inputs(2).data().empty());

  v1::PackMicroBatchesResponse reply;
  reply.set_rank(2);
  reply.add_samples(5);
  v1::Tensor* packed = reply.mutable_packed()->add_packed();
  packed->set_dtype(v1::DTYPE_INT64);
  packed->add_shape(3);
  reply.mutable_packed()->add_cu_seqlens(3);
  const std::string data = RandomBytes(rng, 24);
  const Spliced spliced = SerializeWithPayloads(
      reply, Payloads{{packed, Payload::Of(data.data(), data.size())}});
  ASSERT_EQ(spliced.inserts.size(), 1u);
  v1::PackMicroBatchesResponse expected = reply;
  expected.mutable_packed()->mutable_packed(0)->set_data(data);
  EXPECT_EQ(spliced.size(), static_cast<int64_t>(expected.ByteSizeLong()));
  v1::PackMicroBatchesResponse back;
  ASSERT_TRUE(back.ParseFromString(spliced.TEST_Flatten()));
  EXPECT_TRUE(MessageDifferencer::Equals(back, expected));
}

TEST(WireTest, SplicedMessagesAreProtobufMessages) {
  std::mt19937_64 rng(7);
  const v1::PackRequest original = SampleRequest(rng);
  // Parse (payloads in place), then write back with the payloads spliced in.
  const std::string bytes = original.SerializeAsString();
  v1::PackRequest parsed;
  Payloads payloads;
  ASSERT_TRUE(ParseSplit(bytes, {7, 30}, &parsed, &payloads).ok());
  const Spliced spliced = SerializeWithPayloads(parsed, payloads);
  EXPECT_EQ(spliced.size(), static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(spliced.inserts.size(), 6u);  // one input's payload is split
  v1::PackRequest reparsed;
  ASSERT_TRUE(reparsed.ParseFromString(spliced.TEST_Flatten()));
  EXPECT_TRUE(MessageDifferencer::Equals(reparsed, original));

  // Through gRPC's buffers: header copied, payloads wrapped.
  auto owner = std::make_shared<int>(0);
  std::vector<grpc::Slice> slices;
  std::vector<absl::string_view> chunks;
  {
    const grpc::ByteBuffer buffer = ToByteBuffer(spliced, owner);
    EXPECT_GT(owner.use_count(), 1);
    ASSERT_TRUE(ReadChunks(buffer, &slices, &chunks).ok());
  }
  v1::PackRequest received;
  Payloads received_payloads;
  ASSERT_TRUE(
      ParseWithPayloads(chunks, "PackRequest", &received, &received_payloads)
          .ok());
  EXPECT_EQ(received_payloads.at(&received.inputs(0)).data(),
            payloads.at(&parsed.inputs(0)).data());  // not copied
  EXPECT_TRUE(MessageDifferencer::Equals(
      Materialized(received, received_payloads), original));
  slices.clear();
  EXPECT_EQ(owner.use_count(), 1);
}

// The owner of a message and its bytes: payloads carried from memory whose
// owners it keeps alive, sent without a copy, received in place in the
// slices it holds, and still the message's after the owner is moved.
TEST(WireTest, AWireMessageOwnsItsMessageSlicesAndPayloads) {
  std::mt19937_64 rng(11);
  const v1::PackRequest original = SampleRequest(rng);
  auto x = std::make_shared<std::string>(original.inputs(1).data());
  Wire<v1::PackRequest> sent;
  sent.message() = original;
  sent->mutable_inputs(1)->clear_data();
  sent.Carry(sent->inputs(1), Payload::Of(x->data(), x->size(), x));
  EXPECT_EQ(sent.PayloadBytes(), static_cast<int64_t>(x->size()));

  std::vector<grpc::Slice> pieces;
  {
    Wire<v1::PackRequest> moved = std::move(sent);  // the message stays put
    const grpc::ByteBuffer buffer = ToByteBuffer(moved);
    moved.ReleaseBytes();
    x.reset();  // the buffer's slices still hold the payload's owner
    ASSERT_TRUE(buffer.Dump(&pieces).ok());
  }
  grpc::ByteBuffer received_bytes(pieces.data(), pieces.size());
  Wire<v1::PackRequest> received;
  ASSERT_TRUE(Receive(received_bytes, &received).ok());
  received_bytes.Clear();
  pieces.clear();
  Wire<v1::PackRequest> held = std::move(received);
  ASSERT_NE(held.PayloadOf(held->inputs(1)), nullptr);
  EXPECT_EQ(held.BytesOf(held->inputs(1)).size,
            static_cast<int64_t>(original.inputs(1).data().size()));
  EXPECT_EQ(held.PayloadOf(held->inputs(3)), nullptr);  // a handle: no bytes
  held.CopyPayloadsIntoData();
  EXPECT_TRUE(MessageDifferencer::Equals(held.message(), original));

  Wire<v1::PackRequest> bad;
  // Field 1 (mask) says 5 bytes follow; 2 do.
  const std::vector<absl::string_view> chunks = {
      "\x0a\x05"
      "ab"};
  const absl::Status status = bad.Parse(chunks);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("PackRequest"));
}

TEST(WireTest, EmptyAndPayloadFreeMessages) {
  v1::PackResponse parsed;
  Payloads payloads;
  EXPECT_TRUE(ParseWithPayloads({}, "PackResponse", &parsed, &payloads).ok());
  v1::PackResponse response;
  response.add_cu_seqlens(0);
  response.add_cu_seqlens(3);
  response.add_packed()->set_dtype(v1::DTYPE_FLOAT32);
  const Spliced spliced = SerializeWithPayloads(response, {});
  EXPECT_TRUE(spliced.inserts.empty());
  v1::PackResponse back;
  ASSERT_TRUE(back.ParseFromString(spliced.TEST_Flatten()));
  EXPECT_TRUE(MessageDifferencer::Equals(back, response));
}

}  // namespace
}  // namespace packd
