#include "service/request_decoder.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/buffer.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "kernels/pack_sizes.h"
#include "kernels/registry.h"
#include "proto/tensor_codec.h"
#include "service/row_prefixes.h"

namespace packd {

absl::Status RequestDecoder::CheckSize(absl::string_view what,
                                       size_t bytes) const {
  if (static_cast<int64_t>(bytes) <= max_message_bytes_) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the ", what, " is ", bytes, " bytes, over the server's limit of ",
      max_message_bytes_,
      " bytes (--max_message_bytes); split the batch or use tensor handles"));
}

absl::StatusOr<Device> RequestDecoder::ResolveDevice(
    const std::string& text) const {
  if (text.empty()) return default_device_;
  PACKD_ASSIGN_OR_RETURN(Device device,
                         Registry::Global().ResolveDevice(text, "device"));
  // FAILED_PRECONDITION here when the build or the machine lacks the device.
  PACKD_RETURN_IF_ERROR(Registry::Runtime(device).status());
  return device;
}

namespace {

// For each row of a [B, S] mask, one past the last position whose bytes are
// not all zero: every active position lies before it (a superset of the
// active ones, whatever the dtype).
std::vector<int64_t> RowExtents(const TensorView& mask) {
  const int64_t B = mask.shape[0], S = mask.shape[1];
  const int64_t item = ItemSize(mask.dtype);
  const char* data = static_cast<const char*>(mask.data);
  std::vector<int64_t> extents(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    const char* row = data + b * S * item;
    int64_t end = S * item;
    while (end > 0 && row[end - 1] == 0) --end;
    extents[b] = (end + item - 1) / item;
  }
  return extents;
}

}  // namespace

absl::StatusOr<TensorView> RequestDecoder::DecodeTensor(
    const v1::Tensor& tensor, absl::string_view field,
    DecodedCall* call) const {
  PACKD_ASSIGN_OR_RETURN(TensorView view, DecodeTensorHeader(tensor, field));
  return AttachBytes(tensor, std::move(view), field, call, nullptr);
}

absl::StatusOr<TensorView> RequestDecoder::AttachBytes(
    const v1::Tensor& tensor, TensorView view, absl::string_view field,
    DecodedCall* call, const std::vector<int64_t>* row_extents) const {
  const int64_t bytes = view.nbytes();
  if (tensor.storage_case() == v1::Tensor::kRegion) {
    const std::string slice_field = absl::StrCat(field, ".region");
    PACKD_ASSIGN_OR_RETURN(
        ResolvedSlice slice,
        regions_.Resolve(call->tenant, tensor.region(), slice_field));
    if (slice.byte_size != static_cast<uint64_t>(bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(slice_field, " has ", slice.byte_size,
                       " bytes but shape ", ShapeString(view.shape), " of ",
                       DTypeName(view.dtype), " needs ", bytes));
    }
    view.data = slice.data;
    view.device = slice.region->device();
    call->held.push_back(std::move(slice.region));
    return view;
  }
  const Payload* payload =
      call->wire != nullptr ? call->wire->PayloadOf(tensor) : nullptr;
  const int64_t given = payload != nullptr
                            ? payload->size
                            : static_cast<int64_t>(tensor.data().size());
  if (given != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data has ", given, " bytes but shape ",
                     ShapeString(view.shape), " of ", DTypeName(view.dtype),
                     " needs ", bytes));
  }
  const char* data = tensor.data().data();
  // In place only when contiguous and aligned for the dtype (the kernels read
  // elements as their type); otherwise gathered into an aligned buffer.
  const bool in_place =
      payload != nullptr && payload->contiguous() &&
      reinterpret_cast<uintptr_t>(payload->data()) % ItemSize(view.dtype) == 0;
  if (in_place) {
    data = payload->data();
  } else if (payload != nullptr) {
    PACKD_ASSIGN_OR_RETURN(Buffer gathered_buffer,
                           HostBufferPool::Global().Acquire(bytes));
    char* gathered = static_cast<char*>(gathered_buffer.data());
    const bool by_rows =
        row_extents != nullptr && view.shape.size() >= 2 &&
        view.shape[0] == static_cast<int64_t>(row_extents->size()) &&
        view.shape[0] > 0 &&
        *std::max_element(row_extents->begin(), row_extents->end()) <=
            view.shape[1];
    if (by_rows) {
      // Only the positions whose bytes can reach the result (a host Pack's
      // output depends on active positions only: Backend::Gather); the rest
      // of the buffer may be read but never reaches the result.
      const int64_t row = bytes / view.shape[0];
      GatherRowPrefixes(
          view.shape[0], [](int64_t b) { return b; }, row_extents, row,
          row / view.shape[1], gathered,
          [&](int64_t from, int64_t n, char* to) {
            payload->CopyOut(from, n, to);
          });
    } else {
      payload->CopyOut(0, bytes, gathered);
    }
    data = gathered;
    call->gathered.push_back(std::move(gathered_buffer));
  }
  // The kernels only read inputs; the cast is the usual DLPack-style one.
  view.data = bytes == 0 ? nullptr : const_cast<char*>(data);
  return view;
}

template <typename Request>
absl::StatusOr<DecodedCall> RequestDecoder::DecodeCall(
    const Request& request, const WireMessage& wire,
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
    const CallSpec& spec, bool reads_active_only) const {
  const std::string& prefix = spec.prefix;
  PACKD_RETURN_IF_ERROR(CheckSize(
      "request",
      request.ByteSizeLong() + static_cast<size_t>(wire.PayloadBytes())));
  DecodedCall call;
  call.wire = &wire;
  call.tenant = spec.tenant;
  PACKD_ASSIGN_OR_RETURN(call.device, ResolveDevice(request.device()));
  if (!request.has_mask()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "mask is missing: give a [B, S] tensor"));
  }
  PACKD_ASSIGN_OR_RETURN(TensorView mask, spec.mask);
  PACKD_ASSIGN_OR_RETURN(
      call.mask, AttachBytes(request.mask(), std::move(mask),
                             absl::StrCat(prefix, "mask"), &call, nullptr));
  if (call.mask.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "mask.shape ", ShapeString(call.mask.shape),
        " must have rank 2 ([B, S]), not ", call.mask.shape.size()));
  }
  // A mask of zero-length rows has no bytes, so every size check passes, but
  // the plan and the response hold about 20 bytes per row: hold B against the
  // limit before anything is allocated.
  const int64_t rows = call.mask.shape[0];
  if (rows > MaxBatchRows(max_message_bytes_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(prefix, "mask has B = ", rows,
                     " rows: their cu_seqlens and last_index alone "
                     "need about ",
                     kMetadataBytesPerBatchRow,
                     " bytes each, over the server's "
                     "limit of ",
                     max_message_bytes_, " bytes (--max_message_bytes)"));
  }
  // Inline tensors split over several slices are gathered into one buffer;
  // when the op reads active positions only (Pack on the host), only the
  // positions up to each row's last nonzero mask element are.
  std::vector<int64_t> extents;
  if (reads_active_only && call.device.kind == DeviceKind::kCpu &&
      call.mask.device.kind == DeviceKind::kCpu && call.mask.shape[1] > 0) {
    extents = RowExtents(call.mask);
  }
  call.tensors.reserve(tensors.size());
  for (int i = 0; i < tensors.size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(TensorView header, spec.tensors[i]);
    PACKD_ASSIGN_OR_RETURN(
        TensorView v,
        AttachBytes(
            tensors[i], std::move(header),
            absl::StrCat(prefix,
                         spec.op == CallSpec::Op::kPack ? "inputs" : "packed",
                         "[", i, "]"),
            &call, extents.empty() ? nullptr : &extents));
    call.tensors.push_back(std::move(v));
  }
  const auto& outputs = request.outputs();
  const int results = spec.results;
  if (!outputs.empty()) {
    if (outputs.size() != results) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "outputs has ", outputs.size(), " slices but there are ",
          results,
          results == tensors.size()
              ? " tensors: give one slice per tensor"
              : " results: give one slice per input, then one per shift",
          ", or none for inline results"));
    }
    for (int i = 0; i < outputs.size(); ++i) {
      PACKD_ASSIGN_OR_RETURN(
          ResolvedSlice slice,
          regions_.Resolve(call.tenant, outputs[i],
                           absl::StrCat("outputs[", i, "]")));
      call.outputs.push_back(std::move(slice));
    }
  }
  if (spec.segment_ids.has_value()) {
    PACKD_ASSIGN_OR_RETURN(TensorView header, *spec.segment_ids);
    PACKD_ASSIGN_OR_RETURN(
        call.segment_ids,
        AttachBytes(request.segment_ids(), std::move(header),
                    absl::StrCat(prefix, "segment_ids"), &call, nullptr));
  }
  return call;
}

absl::StatusOr<DecodedCall> RequestDecoder::Decode(
    const Wire<v1::PackRequest>& wire, const CallSpec& spec) const {
  return Decode(wire.message(), wire, spec);
}

absl::StatusOr<DecodedCall> RequestDecoder::Decode(
    const v1::PackRequest& request, const WireMessage& wire,
    const CallSpec& spec) const {
  return DecodeCall(request, wire, request.inputs(), spec,
                    /*reads_active_only=*/true);
}

absl::StatusOr<DecodedCall> RequestDecoder::Decode(
    const Wire<v1::ScatterRequest>& wire, const CallSpec& spec) const {
  return DecodeCall(wire.message(), wire, wire->packed(), spec,
                    /*reads_active_only=*/false);
}

}  // namespace packd
