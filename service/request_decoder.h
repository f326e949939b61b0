// RequestDecoder: a Pack or Scatter request, checked and turned into what the
// op library takes (its headers and layout decoded once, in its CallSpec) — the
// call's device, the mask and tensors as views (of the request's bytes in
// place, or of region memory), and where each result goes. Inline bytes are
// read in place: from the request's payloads (proto/wire.h, the received
// slices) or its data fields, which must outlive the call. Bytes split over
// several slices are first gathered into one pooled buffer.
//
// clang-format off
//   RequestDecoder decoder(regions, Device::Cpu(), max_message_bytes);
//   const CallSpec spec = CallSpec::Of(request.message(), "", max_message_bytes, tenant);
//   PACKD_ASSIGN_OR_RETURN(DecodedCall call, decoder.Decode(request, spec));
//   Pack(call.tensors, call.mask, options);
// clang-format on
#ifndef PACKD_SERVICE_REQUEST_DECODER_H_
#define PACKD_SERVICE_REQUEST_DECODER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/buffer.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/wire.h"
#include "service/call_spec.h"
#include "service/regions.h"

namespace packd {

// A request's device, mask and tensors, checked and decoded. One call's: not
// shared across threads.
struct DecodedCall {
  Device device;
  TensorView mask;
  // inputs (Pack) or packed (Scatter), in request order.
  std::vector<TensorView> tensors;
  // Pack's segment_ids, when the request has them.
  std::optional<TensorView> segment_ids;
  // One resolved slice per result when the request names outputs; empty for
  // inline results.
  std::vector<ResolvedSlice> outputs;
  // The regions the call's tensors live in, kept mapped until it returns.
  std::vector<std::shared_ptr<Region>> held;
  // Buffers that inline tensors split over several slices were gathered into.
  std::vector<Buffer> gathered;
  // The request as received: where its inline tensors' bytes are.
  const WireMessage* wire = nullptr;
  // Whose call it is: the regions it names are this tenant's.
  Tenant tenant;
};

// Safe to share across threads: it changes nothing, and the region registry
// it reads is safe to share.
class RequestDecoder {
 public:
  // `regions` must outlive the decoder.
  RequestDecoder(const RegionRegistry& regions, Device default_device,
                 int64_t max_message_bytes)
      : regions_(regions),
        default_device_(default_device),
        max_message_bytes_(max_message_bytes) {}

  // The tensors of a call whose headers `spec` holds (CallSpec::Of of this
  // request), with their bytes and regions attached. Errors:
  // RESOURCE_EXHAUSTED when the request is over max_message_bytes, or its
  // mask has more rows than that limit allows metadata for;
  // INVALID_ARGUMENT for a missing mask, a bad device name, a tensor whose
  // dtype, shape or byte count is wrong, or outputs of the wrong count;
  // FAILED_PRECONDITION for a device this build or machine lacks; the region
  // errors of RegionRegistry::Resolve for handles. The call's views of inline
  // tensors point into `request`'s bytes, which must outlive them.
  absl::StatusOr<DecodedCall> Decode(const Wire<v1::PackRequest>& request,
                                     const CallSpec& spec) const;
  absl::StatusOr<DecodedCall> Decode(const Wire<v1::ScatterRequest>& request,
                                     const CallSpec& spec) const;
  // A PackRequest inside another message (PackMicroBatchesRequest.batch),
  // whose inline bytes `wire` holds; errors name its fields after the spec's
  // prefix ("batch.").
  absl::StatusOr<DecodedCall> Decode(const v1::PackRequest& request,
                                     const WireMessage& wire,
                                     const CallSpec& spec) const;

  // A view of one tensor's bytes: inline (a cpu view of its payload in
  // call->wire, or of its `data`) or a region slice, whose region is
  // appended to call->held. INVALID_ARGUMENT naming `field` for a bad header,
  // or when the bytes given (inline, or the slice's byte_size) are not exactly
  // numel * itemsize; the region errors of RegionRegistry::Resolve
  // (FAILED_PRECONDITION while handles are disabled); RESOURCE_EXHAUSTED when
  // no memory is left to gather split bytes into.
  absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& tensor,
                                          absl::string_view field,
                                          DecodedCall* call) const;

  // A region slice the call writes to (a step's outputs): the region errors
  // of RegionRegistry::Resolve, naming `field`.
  absl::StatusOr<ResolvedSlice> ResolveSlice(const Tenant& tenant,
                                             const v1::RegionSlice& slice,
                                             absl::string_view field) const {
    return regions_.Resolve(tenant, slice, field);
  }

  // Whether a request's `device` field names the host: "cpu", or empty with
  // the server's default on the host. Anything else (a GPU, a bad name): no.
  bool OnHost(const std::string& device) const {
    return device.empty() ? default_device_.kind == DeviceKind::kCpu
                          : device == "cpu";
  }

  // OK when a message of `bytes` fits max_message_bytes; RESOURCE_EXHAUSTED
  // naming `what` ("request", "response") and the flag otherwise.
  absl::Status CheckSize(absl::string_view what, size_t bytes) const;

 private:
  // The bytes of `tensor`, whose header is `view`, attached to it (as
  // DecodeTensor). When `row_extents` is given and the tensor is [B, S, ...]
  // with one extent per row, split bytes are gathered only for positions
  // [0, row_extents[b]) of each row b (the others are left undefined).
  absl::StatusOr<TensorView> AttachBytes(
      const v1::Tensor& tensor, TensorView view, absl::string_view field,
      DecodedCall* call, const std::vector<int64_t>* row_extents) const;
  template <typename Request>
  absl::StatusOr<DecodedCall> DecodeCall(
      const Request& request, const WireMessage& wire,
      const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors,
      const CallSpec& spec, bool reads_active_only) const;
  absl::StatusOr<Device> ResolveDevice(const std::string& text) const;

  const RegionRegistry& regions_;
  const Device default_device_;
  const int64_t max_message_bytes_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_REQUEST_DECODER_H_
