#include "service/pack_reply.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "proto/tensor_codec.h"

namespace packd {

v1::Tensor* SlotOf(google::protobuf::RepeatedPtrField<v1::Tensor>* field,
                   size_t i) {
  while (field->size() <= static_cast<int>(i)) field->Add();
  return &(*field)[static_cast<int>(i)];
}

OutputAllocator IntoReply(WireMessage* reply, ResultSlot slot,
                          std::vector<Buffer>* buffers, int64_t limit,
                          int64_t reserved) {
  return
      [reply, slot, buffers, limit, used = reserved](
          size_t index, int64_t bytes) mutable -> absl::StatusOr<OutputPlace> {
        used += bytes;
        if (used > limit) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the response would hold at least ", used,
              " bytes, over the server's limit of ", limit,
              " bytes (--max_message_bytes); split the batch or use tensor "
              "handles"));
        }
        const v1::Tensor* tensor = slot(index);
        if (bytes == 0) {
          reply->Carry(*tensor, Payload());
          return OutputPlace{nullptr, Device::Cpu()};
        }
        PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                               HostBufferPool::Global().Acquire(bytes));
        reply->Carry(*tensor, Payload::Of(buffer.data(), bytes));
        void* data = buffer.data();
        buffers->push_back(std::move(buffer));
        return OutputPlace{data, Device::Cpu()};
      };
}

OutputAllocator IntoSlices(const std::vector<ResolvedSlice>* slices) {
  return [slices](size_t i, int64_t bytes) -> absl::StatusOr<OutputPlace> {
    const ResolvedSlice& slice = (*slices)[i];
    if (static_cast<uint64_t>(bytes) > slice.byte_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "] has ", slice.byte_size,
                       " bytes but the result needs ", bytes, " bytes"));
    }
    return OutputPlace{slice.data, slice.region->device()};
  };
}

void EncodeResults(
    const std::vector<ResultTensor>& results,
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
    const ResultSlot& slot) {
  for (size_t i = 0; i < results.size(); ++i) {
    v1::Tensor* out = slot(i);
    EncodeTensorHeader(results[i].view.dtype, results[i].view.shape, out);
    if (!outputs.empty()) {
      v1::RegionSlice* written = out->mutable_region();
      written->set_region(outputs[i].region());
      written->set_offset(outputs[i].offset());
      written->set_byte_size(results[i].view.nbytes());
    }
  }
}

ResultSlot PackSlots(v1::PackResponse* response, size_t inputs) {
  return [response, inputs](size_t i) {
    return i < inputs ? SlotOf(response->mutable_packed(), i)
                      : SlotOf(response->mutable_shifted(), i - inputs);
  };
}

std::vector<ResultTensor> SetPackResponse(PackResult result,
                                          v1::PackResponse* response) {
  response->mutable_cu_seqlens_padded()->Assign(
      result.cu_seqlens_padded.begin(), result.cu_seqlens_padded.end());
  response->set_max_seqlen_padded(result.max_seqlen_padded);
  response->mutable_seq_idx()->Assign(result.seq_idx.begin(),
                                      result.seq_idx.end());
  response->set_token_mask(std::move(result.token_mask));
  response->mutable_mrope_position_ids()->Assign(
      result.mrope_position_ids.begin(), result.mrope_position_ids.end());
  response->mutable_doc_cu_seqlens()->Assign(result.doc_cu_seqlens.begin(),
                                             result.doc_cu_seqlens.end());
  response->set_doc_max_seqlen(result.doc_max_seqlen);
  response->mutable_doc_row()->Assign(result.doc_row.begin(),
                                      result.doc_row.end());
  response->mutable_doc_last_index()->Assign(result.doc_last_index.begin(),
                                             result.doc_last_index.end());
  response->mutable_cu_seqlens()->Assign(result.cu_seqlens.begin(),
                                         result.cu_seqlens.end());
  response->set_total_active(result.total_active);
  response->set_max_seqlen(result.max_seqlen);
  response->mutable_position_ids()->Assign(result.position_ids.begin(),
                                           result.position_ids.end());
  response->mutable_last_index()->Assign(result.last_index.begin(),
                                         result.last_index.end());
  if (result.shared.has_value()) {
    EncodeSharedLayout(*result.shared, response->mutable_shared());
  }
  for (ResultTensor& shifted : result.shifted) {
    result.packed.push_back(std::move(shifted));
  }
  return std::move(result.packed);
}

}  // namespace packd
