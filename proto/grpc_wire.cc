#include "proto/grpc_wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/tsan.h"

namespace packd {
namespace {

// What a payload's slice holds until gRPC releases it.
struct SliceOwners {
  std::shared_ptr<const void> payload;
  std::shared_ptr<const void> keep_alive;
};

}  // namespace

absl::Status ReadChunks(const grpc::ByteBuffer& buffer,
                        std::vector<grpc::Slice>* slices,
                        std::vector<absl::string_view>* chunks) {
  slices->clear();
  chunks->clear();
  if (buffer.Valid()) {
    const grpc::Status status = buffer.Dump(slices);
    if (!status.ok()) {
      return absl::InternalError(
          absl::StrCat("cannot read the message: ", status.error_message()));
    }
  }
  chunks->reserve(slices->size());
  for (const grpc::Slice& slice : *slices) {
    chunks->emplace_back(reinterpret_cast<const char*>(slice.begin()),
                         slice.size());
  }
  return absl::OkStatus();
}

absl::Status Receive(const grpc::ByteBuffer& buffer, WireMessage* message) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  std::vector<absl::string_view> chunks;
  PACKD_RETURN_IF_ERROR(ReadChunks(buffer, slices.get(), &chunks));
  return message->Parse(chunks, std::move(slices));
}

grpc::ByteBuffer ToByteBuffer(const Spliced& message,
                              std::shared_ptr<const void> keep_alive) {
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * message.inserts.size() + 1);
  const grpc::Slice header(message.header);
  size_t from = 0;
  for (const Spliced::Insert& insert : message.inserts) {
    if (insert.at > from) slices.push_back(header.sub(from, insert.at));
    from = insert.at;
    auto* owners = new SliceOwners{insert.owner, keep_alive};
    HandOff(owners);
    slices.emplace_back(
        const_cast<char*>(insert.bytes.data()), insert.bytes.size(),
        [](void* p) {
          TakeOver(p);
          delete static_cast<SliceOwners*>(p);
        },
        owners);
  }
  if (message.header.size() > from) {
    slices.push_back(header.sub(from, message.header.size()));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer ToByteBuffer(const WireMessage& message,
                              std::shared_ptr<const void> keep_alive) {
  return ToByteBuffer(message.Serialize(), std::move(keep_alive));
}

}  // namespace packd
