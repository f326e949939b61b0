// The wire format over gRPC (proto/wire.h is transport neutral): the chunks
// of a received ByteBuffer, a message received in place, and a message sent
// as slices that wrap its payloads without a copy.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(Receive(buffer, &request));
//   grpc::ByteBuffer out = ToByteBuffer(reply.Serialize(), reply_owner);
// clang-format on
#ifndef PACKD_PROTO_GRPC_WIRE_H_
#define PACKD_PROTO_GRPC_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/wire.h"

namespace packd {

// The chunks of a received message: views of the slices of `buffer`, which
// `slices` holds (they must outlive the views). INTERNAL when gRPC cannot
// read the buffer.
absl::Status ReadChunks(const grpc::ByteBuffer& buffer,
                        std::vector<grpc::Slice>* slices,
                        std::vector<absl::string_view>* chunks);

// Parses `buffer` into `message` (WireMessage::Parse), its payloads holding
// the buffer's slices. INVALID_ARGUMENT when the bytes do not parse, INTERNAL
// when gRPC cannot read the buffer.
absl::Status Receive(const grpc::ByteBuffer& buffer, WireMessage* message);

// `message` as a ByteBuffer to send: its header copied once into one slice,
// its payloads wrapped without a copy in slices that hold each insert's owner
// and `keep_alive` until gRPC releases them.
grpc::ByteBuffer ToByteBuffer(const Spliced& message,
                              std::shared_ptr<const void> keep_alive = nullptr);
// The same of a WireMessage (its Serialize()).
grpc::ByteBuffer ToByteBuffer(const WireMessage& message,
                              std::shared_ptr<const void> keep_alive = nullptr);

}  // namespace packd

#endif  // PACKD_PROTO_GRPC_WIRE_H_
