#include "server/pack_scatter_reactor.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status_macros.h"
#include "base/tsan.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/grpc_wire.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// The active positions of an inline [B, S] mask (its header `spec.mask`),
// counted as the op counts them (nonzero: NaN active, -0.0 not); -1 when the
// mask is not inline or not well formed (the decoder refuses it later). A
// scan of the mask alone: a small part of what a Pack reads.
int64_t InlineActive(const Wire<v1::PackRequest>& request,
                     const CallSpec& spec) {
  const v1::Tensor& mask = request->mask();
  if (!spec.mask.ok() || spec.mask->shape.size() != 2 || mask.has_region()) {
    return -1;
  }
  const TensorView& view = *spec.mask;
  const Payload payload = request.BytesOf(mask);
  if (payload.size != view.nbytes()) return -1;
  if (payload.contiguous()) {
    return CountNonzero(view.dtype, payload.data(), view.numel());
  }
  std::string copy(static_cast<size_t>(payload.size), '\0');
  payload.CopyOut(0, payload.size, copy.data());
  return CountNonzero(view.dtype, copy.data(), view.numel());
}
// A Scatter's results do not depend on its mask's values.
int64_t InlineActive(const Wire<v1::ScatterRequest>&, const CallSpec&) {
  return -1;
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
PackScatterReactor<Request, Response>::PackScatterReactor(
    const ReactorEnvironment* env, grpc::GenericCallbackServerContext* context,
    const char* method, Work work)
    : BudgetedReactor<Request>(env, context, method), work_(std::move(work)) {
  this->Start();
}

template <typename Request, typename Response>
absl::StatusOr<int64_t> PackScatterReactor<Request, Response>::Prepare() {
  spec_ = CallSpec::Of(this->parsed_.message(), "",
                       this->env_.max_message_bytes, this->tenant_);
  return std::min(spec_.ResultBytes(InlineActive(this->parsed_, spec_)),
                  this->env_.max_message_bytes);
}

template <typename Request, typename Response>
bool PackScatterReactor<Request, Response>::MayBeSmall(
    size_t request_bytes) const {
  return request_bytes <= this->kSmallCallBytes + kSmallCallMetadataBytes;
}

template <typename Request, typename Response>
bool PackScatterReactor<Request, Response>::Small() const {
  const Request& request = this->parsed_.message();
  if (!request.outputs().empty() ||
      !this->env_.decoder->OnHost(request.device())) {
    return false;
  }
  const int64_t bytes = InlineInputBytes(this->parsed_);
  return bytes >= 0 && bytes <= this->kSmallCallBytes;
}

template <typename Request, typename Response>
void PackScatterReactor<Request, Response>::Serve() {
  this->Done(Guarded(this->method_, [this] { return Run(); }));
}

template <typename Request, typename Response>
void PackScatterReactor<Request, Response>::FinishOk() {
  HandOff(this);  // OnDone runs on one of gRPC's threads
  this->StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
}

template <typename Request, typename Response>
absl::Status PackScatterReactor<Request, Response>::Run() {
  // Owned by the slices of the reply until gRPC has sent them, with the
  // call's share of the budget.
  auto reply = std::make_shared<CallReply<Response>>();
  reply->hold = std::move(this->hold_);
  absl::Status done = work_(this->parsed_, spec_, reply.get());
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

template class PackScatterReactor<v1::PackRequest, v1::PackResponse>;
template class PackScatterReactor<v1::ScatterRequest, v1::ScatterResponse>;

}  // namespace packd
