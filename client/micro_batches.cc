// Client::PackMicroBatches: a training step's call, its batch on the host
// (shared memory or inline bytes) or on a GPU (gpu_calls.cc,
// EncodeStepOnGpu), its micro-batches read as they come.
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/client.h"
#include "proto/grpc_wire.h"
#include "proto/plan_codec.h"

namespace packd {

absl::Status Client::PackMicroBatches(
    const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
    int64_t max_tokens_per_micro_batch, const StepCallOptions& options,
    const std::function<absl::Status(const v1::PlanResponse&)>& on_plan,
    const std::function<absl::Status(StepMicroBatch)>& on_micro_batch) {
  const PackCallOptions& pack = options.pack;
  Named named = {{"mask", &mask},
                 {"segment_ids", &pack.segment_ids},
                 {"loss_mask", &options.loss_mask}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    named.push_back({absl::StrCat("inputs[", i, "]"), &tensors[i]});
  }
  PACKD_ASSIGN_OR_RETURN(std::optional<int> gpu, GpuOf(named));
  if (pack.results_in != nullptr) {
    return absl::InvalidArgumentError(
        "results_in is Pack's; a step's micro-batches come in its stream");
  }
  if (gpu.has_value() && !pack.device.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device \"", pack.device, "\" is for host tensors; these are on ",
        device_memory_->Name(*gpu), ", where the step runs"));
  }
  int64_t bytes = 0;
  for (const auto& [name, t] : named) bytes += t->defined() ? t->nbytes() : 0;
  // The results' arena (after the inputs in the call's segment, or on the
  // tensors' GPU): as large as the last step's results, and a margin (the
  // server sends them inline when it is too small).
  int64_t arena = 0;
  {
    absl::MutexLock lock(&mu_);
    arena = step_output_bytes_;
  }
  if (arena > 0) arena += arena / 8 + (64 << 10);
  Wire<v1::PackMicroBatchesRequest> request;
  Outgoing outgoing(&request);
  *request->mutable_plan() =
      PlanRequestOf(options.plan.ForPlanner(max_tokens_per_micro_batch), {},
                    options.plan.loss_tokens);
  request->mutable_ranks()->Assign(options.ranks.begin(), options.ranks.end());
  // How a micro-batch's results are read: copied out of the shared-memory
  // arena or the reply; on a GPU, views of the step's arena there (which they
  // keep) or inline ones copied to it.
  StepResults results;
  Scratch scratch(nullptr, ScratchReturn{this});
  if (gpu.has_value()) {
    PACKD_ASSIGN_OR_RETURN(results,
                           EncodeStepOnGpu(*gpu, tensors, mask, options, arena,
                                           &request.message(), &outgoing));
  } else {
    PACKD_ASSIGN_OR_RETURN(scratch, ScratchFor(bytes + arena));
    PACKD_RETURN_IF_ERROR(EncodePack(
        pack.device, pack, tensors, mask, pack.segment_ids,
        HostEncoder(scratch.get()), request->mutable_batch(), &outgoing));
    if (options.loss_mask.defined()) {
      PACKD_RETURN_IF_ERROR(EncodeTensor(options.loss_mask, scratch.get(),
                                         request->mutable_loss_mask(),
                                         &outgoing));
    }
    if (scratch != nullptr && arena > 0) {
      if (char* p = scratch->Allocate(arena); p != nullptr) {
        scratch->Contains(p, arena, request->mutable_outputs());
        outgoing.regions.push_back(scratch->region());
      }
    }
    results = [this](const Tensors& got, const WireMessage& reply) {
      return Results({&got}, {&reply}, /*copy_out=*/true);
    };
  }
  bool planned = false;
  auto on_message = [&](const grpc::ByteBuffer& buffer) -> absl::Status {
    Wire<v1::PackMicroBatchesResponse> reply;
    if (absl::Status parsed = Receive(buffer, &reply); !parsed.ok()) {
      return absl::InternalError(
          absl::StrCat("the server's reply: ", parsed.message()));
    }
    if (!planned) {
      planned = true;
      {
        absl::MutexLock lock(&mu_);
        step_output_bytes_ = reply->output_bytes();
      }
      return on_plan(reply->plan());
    }
    PACKD_ASSIGN_OR_RETURN(StepMicroBatch mb,
                           MicroBatchOf(reply, pack, results));
    if (gpu.has_value()) {
      PACKD_RETURN_IF_ERROR(MetadataToDevice(*gpu, &mb.batch));
    }
    return on_micro_batch(std::move(mb));
  };
  absl::Status status =
      connection_->RawStream(kPackMicroBatchesMethod, request, on_message);
  if (status.code() == absl::StatusCode::kNotFound && !planned) {
    // A region of ours may be gone (lease, restart): register, then again.
    absl::StatusOr<bool> missing = Reregister(outgoing.regions);
    if (missing.ok() && *missing) {
      status =
          connection_->RawStream(kPackMicroBatchesMethod, request, on_message);
    }
  }
  return status;
}

absl::StatusOr<StepMicroBatch> Client::MicroBatchOf(
    const Wire<v1::PackMicroBatchesResponse>& reply,
    const PackCallOptions& pack, const StepResults& results) {
  StepMicroBatch mb;
  mb.rank = reply->rank();
  mb.index = reply->index();
  mb.samples.assign(reply->samples().begin(), reply->samples().end());
  mb.through_shared_memory = reply->packed().packed_size() > 0 &&
                             reply->packed().packed(0).has_region();
  PACKD_ASSIGN_OR_RETURN(mb.batch.packed,
                         results(reply->packed().packed(), reply));
  PACKD_ASSIGN_OR_RETURN(mb.batch.shifted,
                         results(reply->packed().shifted(), reply));
  FillMetadata(reply->packed(), pack, &mb.batch);
  return mb;
}

}  // namespace packd
