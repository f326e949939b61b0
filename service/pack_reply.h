// The pieces a call's reply is made of, shared by Pack, Scatter and
// PackMicroBatches: the reply itself (CallReply),
// results written into pooled buffers that the reply wraps without a copy (or
// into the request's output slices), the response tensors' headers, and the
// PackResponse fields of a PackResult.
//
// clang-format off
//   options.allocate = IntoReply(&reply, slot, &buffers, max_message_bytes, reserved);
//   PACKD_ASSIGN_OR_RETURN(PackResult result, Pack(inputs, mask, options));
//   EncodeResults(SetPackResponse(std::move(result), &response), {}, slot);
// clang-format on
#ifndef PACKD_SERVICE_PACK_REPLY_H_
#define PACKD_SERVICE_PACK_REPLY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "base/buffer.h"
#include "kernels/pack.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/wire.h"
#include "service/memory_budget.h"
#include "service/regions.h"

namespace packd {

// The reply of a Pack, Scatter or step message: the response, carrying its
// inline results in the buffers they were written to, which it holds until
// gRPC has sent them, with the call's share of --max_inflight_bytes.
template <typename Response>
struct CallReply {
  Wire<Response> response;
  std::vector<Buffer> buffers;
  MemoryBudget::Hold hold;
};

// The response tensor that result `index` of a call is, added when it is not
// there yet: packed[i] (then shifted[j]) of a Pack, dense[i] of a Scatter.
using ResultSlot = std::function<v1::Tensor*(size_t index)>;

// Slot i of `field`, added when it is not there yet (elements of a repeated
// message field stay where they are as it grows).
v1::Tensor* SlotOf(google::protobuf::RepeatedPtrField<v1::Tensor>* field,
                   size_t i);

// A Pack's result slots in `response`: packed[i] for each of `inputs`, then
// shifted[j].
ResultSlot PackSlots(v1::PackResponse* response, size_t inputs);

// Writes result i into a pooled buffer that `reply` carries, without a copy,
// for the response tensor slot(i); `buffers` keeps the buffers. The running
// total, from `reserved` bytes of metadata, is held against `limit`
// (--max_message_bytes): RESOURCE_EXHAUSTED past it.
OutputAllocator IntoReply(WireMessage* reply, ResultSlot slot,
                          std::vector<Buffer>* buffers, int64_t limit,
                          int64_t reserved);

// Writes result i into the request's output slice i, if it fits.
OutputAllocator IntoSlices(const std::vector<ResolvedSlice>* slices);

// Sets each result tensor's header, and the region slice written when results
// went to the request's outputs.
void EncodeResults(
    const std::vector<ResultTensor>& results,
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
    const ResultSlot& slot);

// Moves a PackResult's metadata into `response`; returns its result tensors,
// the packed ones then the shifted ones, in slot order.
std::vector<ResultTensor> SetPackResponse(PackResult result,
                                          v1::PackResponse* response);

}  // namespace packd

#endif  // PACKD_SERVICE_PACK_REPLY_H_
