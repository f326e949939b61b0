#include "server/inline_call.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status_macros.h"
#include "base/tsan.h"
#include "kernels/pack_sizes.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/grpc_wire.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// The header (dtype and shape) of `t`, or one of no bytes when it is not
// valid (the decoder refuses it later).
TensorView HeaderOf(const v1::Tensor& t) {
  absl::StatusOr<TensorView> view = DecodeTensorHeader(t, "");
  return view.ok() ? *std::move(view) : TensorView{};
}

// The active positions of an inline [B, S] mask, counted as the op counts them
// (nonzero: NaN active, -0.0 not); -1 when the mask is not inline or not well
// formed (the decoder refuses it later). A scan of the mask alone: a small
// part of what a Pack reads.
int64_t InlineActive(const Wire<v1::PackRequest>& request) {
  const v1::Tensor& mask = request->mask();
  absl::StatusOr<TensorView> view = DecodeTensorHeader(mask, "");
  if (!view.ok() || view->shape.size() != 2 || mask.has_region()) return -1;
  const Payload payload = request.BytesOf(mask);
  if (payload.size != view->nbytes()) return -1;
  if (payload.contiguous()) {
    return CountNonzero(view->dtype, payload.data(), view->numel());
  }
  std::string copy(static_cast<size_t>(payload.size), '\0');
  payload.CopyOut(0, payload.size, copy.data());
  return CountNonzero(view->dtype, copy.data(), view->numel());
}

// The bytes of a call's inline results. Pack's (PackSizes): the rows the
// layout can have for the inline mask's active count, else (the mask not
// inline) the inputs' size, which bounds them without a layout.
int64_t ResultBytes(const Wire<v1::PackRequest>& wire) {
  const v1::PackRequest& request = wire.message();
  if (!request.outputs().empty()) return 0;
  std::vector<TensorView> inputs;
  for (const v1::Tensor& t : request.inputs()) inputs.push_back(HeaderOf(t));
  const PackSizes sizes =
      PackSizes::Of(inputs, DecodeLayout(request), request.with_position_ids());
  // Known for an inline [B, S] mask only.
  const int64_t active = InlineActive(wire);
  if (active < 0) return sizes.ResultBytes(-1);
  // Sequences: the rows, or with documents at most one per active token.
  const int64_t sequences = request.has_segment_ids()
                                ? active
                                : std::max<int64_t>(0, request.mask().shape(0));
  return sizes.ResultBytes(sizes.MaxRows(active, sequences));
}
int64_t ResultBytes(const Wire<v1::ScatterRequest>& wire) {
  const v1::ScatterRequest& request = wire.message();
  if (!request.outputs().empty() || request.mask().shape_size() != 2) return 0;
  const int64_t positions =
      SaturatingMul(std::max<int64_t>(0, request.mask().shape(0)),
                    std::max<int64_t>(0, request.mask().shape(1)));
  int64_t bytes = 0;
  for (const v1::Tensor& t : request.packed()) {
    if (t.shape_size() == 0 || t.shape(0) <= 0) continue;
    const int64_t row = HeaderOf(t).nbytes() / t.shape(0);
    bytes = SaturatingAdd(bytes, SaturatingMul(positions, row));
  }
  return bytes;
}

// What a small call's request may carry besides its inputs' bytes: the mask
// and ids, the headers, the layout's fields and the protobuf framing.
constexpr size_t kSmallCallMetadataBytes = 64 << 10;

// The bytes of a call's inputs (Pack's inputs, Scatter's packed tensors),
// all inline; -1 when the call names a region for any of its tensors. The
// mask and ids, a byte or a few a position, are not counted.
template <typename Tensors>
int64_t InlineInputBytes(const WireMessage& wire, const v1::Tensor& mask,
                         const Tensors& inputs, const v1::Tensor& segment_ids) {
  if (mask.has_region() || segment_ids.has_region()) return -1;
  int64_t total = 0;
  for (const v1::Tensor& t : inputs) {
    if (t.has_region()) return -1;
    total += wire.BytesOf(t).size;
  }
  return total;
}
int64_t InlineInputBytes(const Wire<v1::PackRequest>& wire) {
  return InlineInputBytes(wire, wire->mask(), wire->inputs(),
                          wire->segment_ids());
}
int64_t InlineInputBytes(const Wire<v1::ScatterRequest>& wire) {
  return InlineInputBytes(wire, wire->mask(), wire->packed(),
                          wire->segment_ids());
}

}  // namespace

template <typename Request, typename Response>
InlineCall<Request, Response>::InlineCall(
    const CallEnvironment* env, grpc::GenericCallbackServerContext* context,
    const char* method, Work work)
    : BudgetedCall<Request>(env, context, method), work_(std::move(work)) {
  this->Start();
}

template <typename Request, typename Response>
absl::StatusOr<int64_t> InlineCall<Request, Response>::Prepare() {
  return std::min(ResultBytes(this->parsed_), this->env_.max_message_bytes);
}

template <typename Request, typename Response>
bool InlineCall<Request, Response>::MayBeSmall(size_t request_bytes) const {
  return request_bytes <= this->kSmallCallBytes + kSmallCallMetadataBytes;
}

template <typename Request, typename Response>
bool InlineCall<Request, Response>::Small() const {
  const Request& request = this->parsed_.message();
  if (!request.outputs().empty() ||
      !this->env_.decoder->OnHost(request.device())) {
    return false;
  }
  const int64_t bytes = InlineInputBytes(this->parsed_);
  return bytes >= 0 && bytes <= this->kSmallCallBytes;
}

template <typename Request, typename Response>
void InlineCall<Request, Response>::Serve() {
  this->Done(Guarded(this->method_, [this] { return Run(); }));
}

template <typename Request, typename Response>
void InlineCall<Request, Response>::FinishOk() {
  HandOff(this);  // OnDone runs on one of gRPC's threads
  this->StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
}

template <typename Request, typename Response>
absl::Status InlineCall<Request, Response>::Run() {
  // Owned by the slices of the reply until gRPC has sent them, with the
  // call's share of the budget.
  auto reply = std::make_shared<CallReply<Response>>();
  reply->hold = std::move(this->hold_);
  absl::Status done = work_(this->parsed_, reply.get());
  this->ReleaseRequest();
  PACKD_RETURN_IF_ERROR(done);
  const Spliced spliced = reply->response.Serialize();
  // From now on the call holds its reply alone: the rest of its share goes
  // back to the budget for the calls waiting.
  MemoryBudget::ShrinkTo(reply->hold, spliced.size());
  PACKD_RETURN_IF_ERROR(
      this->env_.decoder->CheckSize("response", spliced.size()));
  response_ = ToByteBuffer(spliced, reply);
  this->response_bytes_ = spliced.size();
  return absl::OkStatus();
}

template class InlineCall<v1::PackRequest, v1::PackResponse>;
template class InlineCall<v1::ScatterRequest, v1::ScatterResponse>;

}  // namespace packd
