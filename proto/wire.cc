#include "proto/wire.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/stubs/logging.h"

namespace packd {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr int kTensorData = 3;    // packd.v1.Tensor.data
constexpr int kTensorRegion = 4;  // packd.v1.Tensor.region
constexpr int kMaxGroupDepth = 64;

enum WireType : int {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

// A forward cursor over chunks; copyable, so a field's bytes can be read
// again from its start.
class Cursor {
 public:
  explicit Cursor(absl::Span<const absl::string_view> chunks)
      : chunks_(chunks) {
    SkipEmpty();
  }

  int64_t position() const { return position_; }

  // Reads one byte; false at the end of the chunks.
  bool ReadByte(uint8_t* byte) {
    if (index_ >= chunks_.size()) return false;
    *byte = static_cast<uint8_t>(chunks_[index_][offset_]);
    Advance(1);
    return true;
  }

  // Moves `n` bytes on. Precondition: they exist.
  void Skip(int64_t n) {
    while (n > 0) {
      const int64_t k = std::min<int64_t>(n, Available());
      Advance(k);
      n -= k;
    }
  }

  // Appends views of the next `n` bytes to `pieces` and moves past them.
  // Precondition: they exist.
  void Take(int64_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      const int64_t k = std::min<int64_t>(n, Available());
      pieces->push_back(chunks_[index_].substr(offset_, k));
      Advance(k);
      n -= k;
    }
  }

  // Appends a copy of the next `n` bytes to `out` and moves past them.
  // Precondition: they exist.
  void CopyTo(int64_t n, std::string* out) {
    while (n > 0) {
      const int64_t k = std::min<int64_t>(n, Available());
      out->append(chunks_[index_].data() + offset_, k);
      Advance(k);
      n -= k;
    }
  }

 private:
  int64_t Available() const {
    return static_cast<int64_t>(chunks_[index_].size() - offset_);
  }
  void Advance(int64_t n) {
    offset_ += n;
    position_ += n;
    if (offset_ == chunks_[index_].size()) {
      ++index_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (index_ < chunks_.size() && chunks_[index_].empty()) ++index_;
  }

  absl::Span<const absl::string_view> chunks_;
  size_t index_ = 0;
  size_t offset_ = 0;
  int64_t position_ = 0;
};

// Reads protobuf fields from a Cursor and reports where bytes go wrong.
class Reader {
 public:
  Reader(absl::Span<const absl::string_view> chunks, absl::string_view what)
      : cursor_(chunks), what_(what) {}

  Cursor& cursor() { return cursor_; }
  int64_t position() const { return cursor_.position(); }

  absl::Status Error(int64_t at, absl::string_view field,
                     absl::string_view detail) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", what_, " does not parse: ", field, " at byte ", at, ": ",
        detail, "; send the protobuf encoding of packd.v1.", what_));
  }

  // A varint that must end before `end`.
  absl::Status ReadVarint(int64_t end, absl::string_view field,
                          uint64_t* value) {
    const int64_t at = position();
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t byte = 0;
      if (position() >= end || !cursor_.ReadByte(&byte)) {
        return Error(at, field,
                     "the varint is cut off by the end of its "
                     "message");
      }
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return absl::OkStatus();
    }
    // Like protobuf: bits past the 64th are dropped, an 11th byte is an error.
    return Error(at, field, "the varint is longer than 10 bytes");
  }

  // A tag: field number and wire type.
  absl::Status ReadTag(int64_t end, int* number, int* wire_type) {
    const int64_t at = position();
    uint64_t tag = 0;
    PACKD_RETURN_IF_ERROR(ReadVarint(end, "a field tag", &tag));
    *number = static_cast<int>(std::min<uint64_t>(tag >> 3, INT32_MAX));
    *wire_type = static_cast<int>(tag & 7);
    if (*number == 0 || (tag >> 3) > ((uint64_t{1} << 29) - 1)) {
      return Error(
          at, "a field tag",
          absl::StrCat("field number ", tag >> 3, " is outside 1 .. 2^29 - 1"));
    }
    if (*wire_type > kFixed32) {
      return Error(at, absl::StrCat("field ", *number),
                   absl::StrCat("wire type ", *wire_type, " does not exist"));
    }
    return absl::OkStatus();
  }

  // The length of a length-delimited field, checked against `end`.
  absl::Status ReadLength(int64_t end, absl::string_view field,
                          int64_t* length) {
    const int64_t at = position();
    uint64_t n = 0;
    PACKD_RETURN_IF_ERROR(ReadVarint(end, field, &n));
    const uint64_t left = static_cast<uint64_t>(end - position());
    if (n > left) {
      return Error(at, field,
                   absl::StrCat("its length ", n,
                                " runs past the end of its "
                                "message (",
                                left, " bytes left)"));
    }
    *length = static_cast<int64_t>(n);
    return absl::OkStatus();
  }

  // Moves past the value of a field whose tag was just read.
  absl::Status SkipValue(int64_t end, int number, int wire_type,
                         absl::string_view field, int depth = 0) {
    const int64_t at = position();
    switch (wire_type) {
      case kVarint: {
        uint64_t ignored = 0;
        return ReadVarint(end, field, &ignored);
      }
      case kFixed64:
      case kFixed32: {
        const int64_t n = wire_type == kFixed64 ? 8 : 4;
        if (end - position() < n) {
          return Error(at, field,
                       absl::StrCat("its ", n,
                                    "-byte value is cut "
                                    "off by the end of its message"));
        }
        cursor_.Skip(n);
        return absl::OkStatus();
      }
      case kLengthDelimited: {
        int64_t n = 0;
        PACKD_RETURN_IF_ERROR(ReadLength(end, field, &n));
        cursor_.Skip(n);
        return absl::OkStatus();
      }
      case kStartGroup: {
        if (depth >= kMaxGroupDepth) {
          return Error(at, field, "groups nest too deeply");
        }
        while (true) {
          int inner = 0, inner_type = 0;
          if (position() >= end) {
            return Error(at, field, "the group has no end-group tag");
          }
          PACKD_RETURN_IF_ERROR(ReadTag(end, &inner, &inner_type));
          if (inner_type == kEndGroup) {
            if (inner == number) return absl::OkStatus();
            return Error(at, field, "its end-group tag has another number");
          }
          PACKD_RETURN_IF_ERROR(
              SkipValue(end, inner, inner_type, field, depth + 1));
        }
      }
      default:
        return Error(at, field, "an end-group tag without its start");
    }
  }

 private:
  Cursor cursor_;
  absl::string_view what_;
};

// The bytes of the field that starts at `start` (tag included) up to the
// reader's position, appended to `out`.
void CopyField(Cursor start, const Reader& reader, std::string* out) {
  start.CopyTo(reader.position() - start.position(), out);
}

// Parses one packd.v1.Tensor value of `length` bytes into `tensor` (merging),
// its inline bytes into `payloads`.
absl::Status ParseTensor(Reader& reader, int64_t length,
                         const std::string& field, v1::Tensor* tensor,
                         Payloads* payloads) {
  const int64_t end = reader.position() + length;
  std::string rest;
  Payload data;
  int storage = 0;  // the oneof member seen last: kTensorData, kTensorRegion
  while (reader.position() < end) {
    const Cursor start = reader.cursor();
    int number = 0, wire_type = 0;
    PACKD_RETURN_IF_ERROR(reader.ReadTag(end, &number, &wire_type));
    if (number == kTensorData && wire_type == kLengthDelimited) {
      int64_t n = 0;
      PACKD_RETURN_IF_ERROR(
          reader.ReadLength(end, absl::StrCat(field, ".data"), &n));
      data = Payload();
      reader.cursor().Take(n, &data.pieces);
      data.size = n;
      storage = kTensorData;
      continue;
    }
    if (number == kTensorRegion && wire_type == kLengthDelimited) {
      storage = kTensorRegion;
    }
    PACKD_RETURN_IF_ERROR(reader.SkipValue(
        end, number, wire_type, absl::StrCat(field, " field ", number)));
    CopyField(start, reader, &rest);
  }
  // Protobuf would also log what it refuses: the status says it instead.
  google::protobuf::LogSilencer silence;
  if (!rest.empty() && !tensor->MergeFromString(rest)) {
    return reader.Error(end - length, field,
                        "protobuf refuses its fields (a dtype, shape or "
                        "region of the wrong type?)");
  }
  if (storage == kTensorData) {
    tensor->set_data(std::string());
    (*payloads)[tensor] = std::move(data);
  } else if (storage == kTensorRegion) {
    payloads->erase(tensor);
  }
  return absl::OkStatus();
}

}  // namespace

Payload Payload::Of(const void* data, int64_t bytes,
                    std::shared_ptr<const void> owner) {
  Payload payload;
  payload.size = bytes;
  payload.owner = std::move(owner);
  if (bytes > 0) {
    payload.pieces.emplace_back(static_cast<const char*>(data),
                                static_cast<size_t>(bytes));
  }
  return payload;
}

void Payload::CopyOut(int64_t offset, int64_t n, char* out) const {
  for (absl::string_view piece : pieces) {
    if (n == 0) return;
    const int64_t size = static_cast<int64_t>(piece.size());
    if (offset >= size) {
      offset -= size;
      continue;
    }
    const int64_t k = std::min(n, size - offset);
    std::memcpy(out, piece.data() + offset, k);
    out += k;
    n -= k;
    offset = 0;
  }
}

namespace {

// How deep messages that hold tensors nest (PackMicroBatchesResponse.packed is
// a PackResponse: 2).
constexpr int kMaxTensorDepth = 4;

// Whether messages of type `d` hold packd.v1.Tensor fields, in themselves or
// in a message field (a PackRequest inside a PackMicroBatchesRequest).
bool HoldsTensors(const Descriptor* d, int depth = 0) {
  if (d == nullptr || d == v1::Tensor::descriptor() ||
      depth >= kMaxTensorDepth) {
    return false;
  }
  for (int i = 0; i < d->field_count(); ++i) {
    const Descriptor* m = d->field(i)->message_type();
    if (m == v1::Tensor::descriptor() || HoldsTensors(m, depth + 1))
      return true;
  }
  return false;
}

// Parses the fields up to `end` into `message` (merging): tensor fields keep
// their inline bytes in `payloads`, and so do those of message fields that
// hold tensors. `prefix` names the message's place in the top-level one.
absl::Status ParseFields(Reader& reader, int64_t end, Message* message,
                         const std::string& prefix, int depth,
                         Payloads* payloads) {
  const Descriptor* descriptor = message->GetDescriptor();
  const Reflection* reflection = message->GetReflection();
  std::string field_bytes;
  while (reader.position() < end) {
    const Cursor start = reader.cursor();
    const int64_t at = reader.position();
    int number = 0, wire_type = 0;
    PACKD_RETURN_IF_ERROR(reader.ReadTag(end, &number, &wire_type));
    const FieldDescriptor* field = descriptor->FindFieldByNumber(number);
    std::string name =
        absl::StrCat(prefix, field != nullptr ? field->name()
                                              : absl::StrCat("field ", number));
    const Descriptor* type = field != nullptr ? field->message_type() : nullptr;
    const bool tensor = type == v1::Tensor::descriptor();
    if (wire_type == kLengthDelimited &&
        (tensor || (depth + 1 < kMaxTensorDepth && HoldsTensors(type)))) {
      int64_t n = 0;
      PACKD_RETURN_IF_ERROR(reader.ReadLength(end, name, &n));
      Message* sub = nullptr;
      if (field->is_repeated()) {
        name = absl::StrCat(name, "[", reflection->FieldSize(*message, field),
                            "]");
        sub = reflection->AddMessage(message, field);
      } else {
        sub = reflection->MutableMessage(message, field);
      }
      if (tensor) {
        PACKD_RETURN_IF_ERROR(ParseTensor(
            reader, n, name, static_cast<v1::Tensor*>(sub), payloads));
      } else {
        PACKD_RETURN_IF_ERROR(ParseFields(reader, reader.position() + n, sub,
                                          absl::StrCat(name, "."), depth + 1,
                                          payloads));
      }
      continue;
    }
    PACKD_RETURN_IF_ERROR(reader.SkipValue(end, number, wire_type, name));
    field_bytes.clear();
    CopyField(start, reader, &field_bytes);
    google::protobuf::LogSilencer silence;
    if (!message->MergeFromString(field_bytes)) {
      return reader.Error(at, name,
                          "protobuf refuses its value (a string that is not "
                          "UTF-8, or a message that does not parse)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseWithPayloads(absl::Span<const absl::string_view> chunks,
                               absl::string_view what, Message* message,
                               Payloads* payloads) {
  message->Clear();
  payloads->clear();
  int64_t end = 0;
  for (absl::string_view chunk : chunks) end += chunk.size();
  Reader reader(chunks, what);
  return ParseFields(reader, end, message, "", 0, payloads);
}

void CopyPayloadsIntoData(const Payloads& payloads) {
  for (const auto& [tensor, payload] : payloads) {
    std::string* data = const_cast<v1::Tensor*>(tensor)->mutable_data();
    data->resize(payload.size);
    payload.CopyOut(0, payload.size, data->data());
  }
}

namespace {

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

int VarintSize(uint64_t value) {
  int n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

void AppendTag(int number, int wire_type, std::string* out) {
  AppendVarint((static_cast<uint64_t>(number) << 3) | wire_type, out);
}

// Appends tensor `t` as field `number`, with `payload` as its data when given.
void AppendTensor(int number, const v1::Tensor& t, const Payload* payload,
                  Spliced* out) {
  std::string& header = out->header;
  if (payload == nullptr) {
    AppendTag(number, kLengthDelimited, &header);
    AppendVarint(t.ByteSizeLong(), &header);
    t.AppendToString(&header);
    return;
  }
  v1::Tensor head;
  head.set_dtype(t.dtype());
  *head.mutable_shape() = t.shape();
  const std::string head_bytes = head.SerializeAsString();
  const uint64_t n = static_cast<uint64_t>(payload->size);
  const uint64_t inner = head_bytes.size() +
                         VarintSize((kTensorData << 3) | kLengthDelimited) +
                         VarintSize(n) + n;
  AppendTag(number, kLengthDelimited, &header);
  AppendVarint(inner, &header);
  header += head_bytes;
  AppendTag(kTensorData, kLengthDelimited, &header);
  AppendVarint(n, &header);
  for (absl::string_view piece : payload->pieces) {
    if (!piece.empty()) {
      out->inserts.push_back({header.size(), piece, payload->owner});
    }
  }
}

}  // namespace

int64_t Spliced::size() const {
  int64_t n = static_cast<int64_t>(header.size());
  for (const Insert& insert : inserts) n += insert.bytes.size();
  return n;
}

std::string Spliced::TEST_Flatten() const {
  std::string out;
  out.reserve(size());
  size_t from = 0;
  for (const Insert& insert : inserts) {
    out.append(header, from, insert.at - from);
    out.append(insert.bytes.data(), insert.bytes.size());
    from = insert.at;
  }
  out.append(header, from, std::string::npos);
  return out;
}

namespace {

// Appends `message`'s encoding to `out`, tensors in `payloads` carrying those
// bytes, recursing into message fields that hold tensors.
void AppendMessage(const Message& message, const Payloads& payloads, int depth,
                   Spliced* out) {
  const Reflection* reflection = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  std::vector<const FieldDescriptor*> special;  // tensors, and their holders
  for (const FieldDescriptor* field : fields) {
    const Descriptor* type = field->message_type();
    if (type == v1::Tensor::descriptor() ||
        (depth + 1 < kMaxTensorDepth && HoldsTensors(type))) {
      special.push_back(field);
    }
  }
  if (special.empty()) {
    message.AppendToString(&out->header);
    return;
  }
  std::unique_ptr<Message> rest(message.New());
  rest->CopyFrom(message);
  for (const FieldDescriptor* field : special) {
    rest->GetReflection()->ClearField(rest.get(), field);
  }
  rest->AppendToString(&out->header);
  for (const FieldDescriptor* field : special) {
    const int count =
        field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    for (int i = 0; i < count; ++i) {
      const Message& sub =
          field->is_repeated()
              ? reflection->GetRepeatedMessage(message, field, i)
              : reflection->GetMessage(message, field);
      if (field->message_type() == v1::Tensor::descriptor()) {
        auto it = payloads.find(static_cast<const v1::Tensor*>(&sub));
        AppendTensor(field->number(), static_cast<const v1::Tensor&>(sub),
                     it == payloads.end() ? nullptr : &it->second, out);
        continue;
      }
      Spliced inner;
      AppendMessage(sub, payloads, depth + 1, &inner);
      AppendTag(field->number(), kLengthDelimited, &out->header);
      AppendVarint(static_cast<uint64_t>(inner.size()), &out->header);
      const size_t base = out->header.size();
      for (Spliced::Insert& insert : inner.inserts) {
        insert.at += base;
        out->inserts.push_back(std::move(insert));
      }
      out->header += inner.header;
    }
  }
}

}  // namespace

Spliced SerializeWithPayloads(const Message& message,
                              const Payloads& payloads) {
  Spliced out;
  AppendMessage(message, payloads, 0, &out);
  return out;
}

const Payload* WireMessage::PayloadOf(const v1::Tensor& t) const {
  auto it = payloads_.find(&t);
  return it != payloads_.end() ? &it->second : nullptr;
}

Payload WireMessage::BytesOf(const v1::Tensor& t) const {
  const Payload* payload = PayloadOf(t);
  return payload != nullptr
             ? *payload
             : Payload::Of(t.data().data(),
                           static_cast<int64_t>(t.data().size()));
}

int64_t WireMessage::PayloadBytes() const {
  int64_t bytes = 0;
  for (const auto& [tensor, payload] : payloads_) bytes += payload.size;
  return bytes;
}

int64_t WireMessage::SplitPayloadBytes() const {
  int64_t bytes = 0;
  for (const auto& [tensor, payload] : payloads_) {
    if (!payload.contiguous()) bytes += payload.size;
  }
  return bytes;
}

void WireMessage::Carry(const v1::Tensor& t, Payload payload) {
  payloads_[&t] = std::move(payload);
}

absl::Status WireMessage::Parse(absl::Span<const absl::string_view> chunks,
                                std::shared_ptr<const void> owner) {
  payloads_.clear();
  PACKD_RETURN_IF_ERROR(ParseWithPayloads(
      chunks, message_->GetDescriptor()->name(), message_.get(), &payloads_));
  for (auto& [tensor, payload] : payloads_) payload.owner = owner;
  return absl::OkStatus();
}

void WireMessage::CopyPayloadsIntoData() {
  ::packd::CopyPayloadsIntoData(payloads_);
  payloads_.clear();
}

void WireMessage::ReleaseBytes() { payloads_.clear(); }

}  // namespace packd
