// Client::SubmitGroup and Client::ReceiveStep: the streaming step's calls for
// rollout workers and trainer ranks (docs/operation.md, "The streaming step").
#include <string>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "client/client.h"
#include "proto/grpc_wire.h"
#include "proto/tensor_codec.h"

namespace packd {

absl::StatusOr<v1::SubmitGroupResponse> Client::SubmitGroup(
    const std::string& step_id, const std::vector<at::Tensor>& tensors,
    const at::Tensor& mask, const GroupOptions& options) {
  Wire<v1::SubmitGroupRequest> request;
  Outgoing outgoing(&request);
  request->set_step_id(step_id);
  request->set_policy_version(options.policy_version);
  if (options.group_key.empty()) {
    absl::BitGen bits;
    request->set_group_key(absl::StrFormat("%016x%016x",
                                           absl::Uniform<uint64_t>(bits),
                                           absl::Uniform<uint64_t>(bits)));
  } else {
    request->set_group_key(options.group_key);
  }
  // Inline bytes, sent from the tensors' own memory.
  auto encode = [&](const at::Tensor& t, v1::Tensor* out) {
    return EncodeTensor(t, /*scratch=*/nullptr, out, &outgoing);
  };
  PACKD_RETURN_IF_ERROR(encode(mask, request->mutable_mask()));
  for (const at::Tensor& t : tensors) {
    PACKD_RETURN_IF_ERROR(encode(t, request->add_inputs()));
  }
  if (options.segment_ids.defined()) {
    PACKD_RETURN_IF_ERROR(
        encode(options.segment_ids, request->mutable_segment_ids()));
  }
  if (options.loss_mask.defined()) {
    PACKD_RETURN_IF_ERROR(
        encode(options.loss_mask, request->mutable_loss_mask()));
  }
  request->mutable_prefix_lengths()->Assign(options.prefix_lengths.begin(),
                                            options.prefix_lengths.end());
  CallTimes times;
  times.attempt = options.attempt_timeout > absl::ZeroDuration()
                      ? options.attempt_timeout
                      : connection_->options().deadline / 4;
  Wire<v1::SubmitGroupResponse> reply;
  PACKD_RETURN_IF_ERROR(
      connection_->RawCall(0, kSubmitGroupMethod, request, &reply, times));
  return reply.message();
}

absl::StatusOr<v1::PlanResponse> Client::ReceiveStep(
    const std::string& step_id, int rank, int cp_rank, bool cu_seqlens_int32,
    const std::function<absl::Status(StepMicroBatch)>& on_micro_batch) {
  Wire<v1::ReceiveStepRequest> request;
  request->set_step_id(step_id);
  request->set_rank(rank);
  request->set_cp_rank(cp_rank);
  std::optional<v1::PlanResponse> last;
  const StepResults results = [this](const Tensors& got,
                                     const WireMessage& reply) {
    return Results({&got}, {&reply}, /*copy_out=*/true);
  };
  auto on_message = [&](const grpc::ByteBuffer& buffer) -> absl::Status {
    Wire<v1::PackMicroBatchesResponse> reply;
    if (absl::Status parsed = Receive(buffer, &reply); !parsed.ok()) {
      return absl::InternalError(
          absl::StrCat("the server's reply: ", parsed.message()));
    }
    if (reply->has_plan()) {
      last = reply->plan();
      return absl::OkStatus();
    }
    // Read with the step's own layout; documents where its groups carry
    // segment ids (then the reply has their bounds).
    const v1::PackRequest& layout = reply->layout();
    PackCallOptions pack;
    pack.with_position_ids = layout.with_position_ids();
    pack.cu_seqlens_int32 = cu_seqlens_int32;
    pack.layout = DecodeLayout(layout);
    pack.with_token_mask = layout.with_token_mask();
    if (reply->packed().doc_cu_seqlens_size() > 0) {
      pack.segment_ids = at::empty({0}, at::kLong);
    }
    PACKD_ASSIGN_OR_RETURN(StepMicroBatch mb,
                           MicroBatchOf(reply, pack, results));
    return on_micro_batch(std::move(mb));
  };
  // The stream lives as long as the step: an hour, or the client's
  // deadline when longer.
  CallTimes times;
  times.total = std::max(connection_->options().deadline, absl::Hours(1));
  PACKD_RETURN_IF_ERROR(
      connection_->RawStream(kReceiveStepMethod, request, on_message, times));
  if (!last.has_value()) {
    return absl::InternalError(
        "the step's stream ended without its last message");
  }
  return *std::move(last);
}

}  // namespace packd
