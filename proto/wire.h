// Tensor-aware protobuf wire format: packd.v1 messages read from, and written
// to, a sequence of byte chunks without copying tensor bytes. Transport
// neutral: gRPC's side (slices, byte buffers) is proto/grpc_wire.h.
//
// The packd.v1.Tensor fields of a message (PackRequest.mask, inputs,
// segment_ids; PackResponse.packed; ...), and those of its message fields that
// hold tensors (PackMicroBatchesRequest.batch.inputs), carry their inline
// `data` as a Payload: the chunks that hold it, in place. Everything else is
// small and is parsed by protobuf. The bytes on the wire are exactly the
// protobuf encoding of the message, so plain protobuf peers cannot tell the
// difference.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(ParseWithPayloads(chunks, "PackRequest", &request, &payloads));
//   Spliced out = SerializeWithPayloads(response, payloads);
// clang-format on
#ifndef PACKD_PROTO_WIRE_H_
#define PACKD_PROTO_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/tsan.h"
#include "google/protobuf/message.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {

// Call metadata in which a Pack or Scatter client declares the size of its
// serialized request, so that the server's memory budget admits the call for
// what it needs rather than for the largest request. A request larger than it
// declares is refused (INVALID_ARGUMENT).
inline constexpr char kRequestBytesHeader[] = "packd-request-bytes";

// Inline tensor bytes, in place: the concatenation of `pieces`, whose memory
// `owner` keeps alive (the received slices, or the buffer a result was
// written to; null when the caller keeps it alive itself).
struct Payload {
  std::vector<absl::string_view> pieces;
  int64_t size = 0;
  std::shared_ptr<const void> owner;

  // A payload of one contiguous range.
  static Payload Of(const void* data, int64_t bytes,
                    std::shared_ptr<const void> owner = nullptr);
  // Whether the bytes are contiguous (one piece, or none).
  bool contiguous() const { return pieces.size() <= 1; }
  // The first byte when contiguous (nullptr for an empty payload).
  const char* data() const {
    return pieces.empty() ? nullptr : pieces.front().data();
  }
  // Copies bytes [offset, offset + n) to `out`. Precondition: the range lies
  // within the payload.
  void CopyOut(int64_t offset, int64_t n, char* out) const;
};

// The payload of each inline tensor of a message, by the tensor it belongs to.
// A tensor of the message not listed here has its bytes (if any) in its own
// `data` field.
using Payloads = absl::flat_hash_map<const v1::Tensor*, Payload>;

// Parses the bytes `chunks` hold as `message` (cleared first). Tensor fields at
// the top level (and in message fields that hold tensors) keep their inline
// bytes in place: their `data` is set empty and `payloads` gets the bytes,
// which live as long as the chunks. Protobuf's rules hold: fields in any order,
// repeated fields appended, singular messages merged, the last of a oneof
// winning, unknown fields kept. INVALID_ARGUMENT naming `what` (the message
// type, as the caller calls it), the field and its byte offset when the bytes
// do not parse: a truncated tag, varint or field, a length past the end of its
// message, a bad wire type or field number, or a field protobuf refuses (such
// as a string that is not UTF-8).
absl::Status ParseWithPayloads(absl::Span<const absl::string_view> chunks,
                               absl::string_view what,
                               google::protobuf::Message* message,
                               Payloads* payloads);

// Copies each payload into its tensor's `data` field: the message as plain
// protobuf holds it, for code that takes messages rather than payloads. The
// tensors must belong to a message the caller may change.
void CopyPayloadsIntoData(const Payloads& payloads);

// A message to send: `header` holds every byte but the payloads, and each
// insert's bytes go in at its byte `at` of `header` (in order), their memory
// kept alive by its `owner`.
struct Spliced {
  struct Insert {
    size_t at;
    absl::string_view bytes;
    std::shared_ptr<const void> owner;
  };
  std::string header;
  std::vector<Insert> inserts;

  int64_t size() const;

  // Extra methods (for testing): the message as one string.
  std::string TEST_Flatten() const;
};

// `message` serialized with the tensors in `payloads` carrying those
// bytes as their `data`: the protobuf encoding of the message those tensors'
// data fields set (their own `data` and `region` are ignored). Other tensors
// are written as they are.
Spliced SerializeWithPayloads(const google::protobuf::Message& message,
                              const Payloads& payloads);

// A message with its tensors' bytes in place, each payload holding what keeps
// its bytes alive (the slices it was received in, or the memory it is sent
// from). It holds the message on the heap and is the only way to reach its
// payloads, so a payload is always found through the message it belongs to:
// moving a WireMessage never moves the message, and it cannot be copied. What
// every side uses (the server, the request decoder, the clients, packctl); the
// free functions above are its parts, and proto/grpc_wire.h its transport.
// Not safe to share across threads while it changes.
//
// clang-format off
//   Wire<v1::PackResponse> reply;
//   PACKD_RETURN_IF_ERROR(Receive(buffer, &reply));   // proto/grpc_wire.h
//   Payload bytes = reply.BytesOf(reply->packed(0));
// clang-format on
class WireMessage {
 public:
  WireMessage(WireMessage&&) = default;
  WireMessage& operator=(WireMessage&&) = default;
  WireMessage(const WireMessage&) = delete;
  WireMessage& operator=(const WireMessage&) = delete;

  google::protobuf::Message& base() { return *message_; }
  const google::protobuf::Message& base() const { return *message_; }

  // The payload of `t`, a tensor of the message, or null when its
  // bytes (if any) are in its own `data` field.
  const Payload* PayloadOf(const v1::Tensor& t) const;
  // The bytes of `t`: its payload, or its own `data` field.
  Payload BytesOf(const v1::Tensor& t) const;
  // Bytes of the inline tensors carried as payloads, and of those among them
  // that arrived in several pieces (a reader gathers those into one buffer).
  int64_t PayloadBytes() const;
  int64_t SplitPayloadBytes() const;

  // `t`, a tensor of the message, carries `payload` (whose owner keeps its
  // memory alive until the message and any buffer sent from it are gone).
  void Carry(const v1::Tensor& t, Payload payload);

  // Parses `chunks` (as ParseWithPayloads, naming the message's type), which
  // `owner` keeps alive (null: the caller does, as long as the message).
  absl::Status Parse(absl::Span<const absl::string_view> chunks,
                     std::shared_ptr<const void> owner = nullptr);
  // The message as plain protobuf: each payload copied into its `data`.
  void CopyPayloadsIntoData();

  // The message to send: the encoding of the message with the payloads as
  // the tensors' data, each insert holding its payload's owner.
  Spliced Serialize() const {
    return SerializeWithPayloads(*message_, payloads_);
  }

  // Lets go of the message's bytes (its payloads and their owners); the
  // message keeps its fields, its tensors' data empty.
  void ReleaseBytes();

 protected:
  explicit WireMessage(std::unique_ptr<google::protobuf::Message> message)
      : message_(std::move(message)) {}

 private:
  std::unique_ptr<google::protobuf::Message> message_;
  Payloads payloads_;
};

// A WireMessage of type M.
template <typename M>
class Wire : public WireMessage {
 public:
  Wire() : WireMessage(std::make_unique<M>()) {}
  M& message() { return static_cast<M&>(base()); }
  const M& message() const { return static_cast<const M&>(base()); }
  M* operator->() { return &message(); }
  const M* operator->() const { return &message(); }
};

}  // namespace packd

#endif  // PACKD_PROTO_WIRE_H_
