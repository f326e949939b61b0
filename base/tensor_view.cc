#include "base/tensor_view.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace packd {

std::string Device::ToString() const {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return absl::StrCat("cuda:", index);
    case DeviceKind::kHip:
      return absl::StrCat("hip:", index);
  }
  return "unknown";
}

absl::StatusOr<Device> ParseDevice(absl::string_view text,
                                   absl::string_view field) {
  auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", text,
        "\" is not a device: expected \"cpu\", \"cuda:N\" or \"hip:N\""));
  };
  if (text == "cpu") return Device::Cpu();
  Device device;
  absl::string_view rest;
  if (absl::StartsWith(text, "cuda")) {
    device.kind = DeviceKind::kCuda;
    rest = text.substr(4);
  } else if (absl::StartsWith(text, "hip")) {
    device.kind = DeviceKind::kHip;
    rest = text.substr(3);
  } else {
    return invalid();
  }
  if (rest.empty()) return device;
  if (rest[0] != ':' || rest.size() < 2 || rest.size() > 5) return invalid();
  rest.remove_prefix(1);
  for (char c : rest) {
    if (c < '0' || c > '9') return invalid();
  }
  int index = 0;
  if (!absl::SimpleAtoi(rest, &index) || index > 1023) return invalid();
  device.index = index;
  return device;
}

std::string FormatDeviceUuid(const unsigned char bytes[16]) {
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    absl::StrAppend(&out, absl::Hex(bytes[i], absl::kZeroPad2));
  }
  return out;
}

std::string CanonicalDeviceUuid(absl::string_view uuid) {
  std::string out = absl::AsciiStrToLower(uuid);
  if (!absl::StartsWith(out, "gpu-")) return absl::StrCat("GPU-", out);
  out.replace(0, 4, "GPU-");
  return out;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape,
                                    absl::string_view field) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape ", ShapeString(shape),
                       " has a negative dim at index ", i));
    }
  }
  for (int64_t d : shape) {
    if (!CheckedMul(n, d, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape ", ShapeString(shape),
                       " has more elements than int64 can count"));
    }
  }
  return n;
}

absl::StatusOr<int64_t> ByteSize(DType dtype, absl::Span<const int64_t> shape,
                                 absl::string_view field) {
  if (!IsValidDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype ", static_cast<int>(dtype),
                     " is not a supported dtype"));
  }
  auto n = NumElements(shape, field);
  if (!n.ok()) return n.status();
  int64_t bytes = 0;
  if (!CheckedMul(*n, ItemSize(dtype), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape ", ShapeString(shape), " of ", DTypeName(dtype),
        " has a byte size that overflows int64"));
  }
  return bytes;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace packd
