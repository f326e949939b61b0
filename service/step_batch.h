// StepBatch: the batch of a training step (docs/design.md §12), decoded once
// and checked to be in host memory or on the step's device, with the [B, S]
// tensors the plan reads (the mask, segment ids and loss mask) brought to the
// host in one wait. It gathers any micro-batch's rows as a batch of their own
// (Gather) and checks the request's outputs against it (ResolveOutputs).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto batch, StepBatch::Make(request, decoder, spec));
//   Pack({batch->loss_mask().value_or(batch->mask())}, batch->mask(), host);
//   PACKD_ASSIGN_OR_RETURN(GatheredRows rows, batch->GatherRows(samples, &extents));
// clang-format on
#ifndef PACKD_SERVICE_STEP_BATCH_H_
#define PACKD_SERVICE_STEP_BATCH_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/buffer.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/wire.h"
#include "service/call_spec.h"
#include "service/request_decoder.h"

namespace packd {

// Rows of a batch gathered in plan order: a [R, S, ...] batch of their own,
// in the buffers `held` keeps (host memory, or the inputs' device memory).
struct GatheredRows {
  TensorView mask;
  std::vector<TensorView> inputs;
  std::optional<TensorView> segment_ids;
  std::vector<Buffer> held;
};

// Make changes the batch; once made, its const members may be called from
// several threads at once.
class StepBatch {
 public:
  // Decodes `request`'s batch (which must outlive the step batch) with
  // `spec`, and its loss mask; checks that each tensor is in host memory or
  // on batch.device, and brings the mask, segment ids and loss mask to the
  // host when they are not, waited for once. Errors: the decoder's;
  // INVALID_ARGUMENT for a tensor in a region on another device than
  // batch.device, naming its field, and for a loss mask not of the mask's
  // shape; the device's (FAILED_PRECONDITION when it is missing, UNAVAILABLE
  // once lost).
  static absl::StatusOr<std::unique_ptr<StepBatch>> Make(
      const Wire<v1::PackMicroBatchesRequest>& request,
      const RequestDecoder& decoder, const CallSpec& spec);
  // The batch of a call already decoded, `loss_mask` (when given) of its
  // mask's shape: Make's checks after decoding, and the copies to the host.
  static absl::StatusOr<std::unique_ptr<StepBatch>> Of(
      DecodedCall call, std::optional<TensorView> loss_mask);

  // The batch as decoded: its tensors where the request put them.
  const DecodedCall& call() const { return call_; }
  const Device& device() const { return call_.device; }
  // The mask, segment ids and loss mask in host memory.
  const TensorView& mask() const { return host_mask_; }
  const std::optional<TensorView>& segment_ids() const {
    return host_segment_ids_;
  }
  const std::optional<TensorView>& loss_mask() const { return host_loss_; }

  // `t` in host memory: itself, or a copy that the batch keeps.
  absl::StatusOr<TensorView> OnHost(const TensorView& t);

  // Rows `rows` of the batch, in that order, as a batch of their own: the
  // mask and segment ids from their host copies, and each input: in host
  // memory into pooled buffers (only positions [0, extents[b]) of row b when
  // `extents` is given: what Pack on the host reads), or on its device, whole
  // rows (DeviceRuntime::CopyRows), waited for before this returns.
  absl::StatusOr<GatheredRows> GatherRows(
      absl::Span<const int64_t> rows,
      const std::vector<int64_t>* extents) const;
  // The same rows' mask and segment ids alone (no inputs), in host memory.
  absl::StatusOr<GatheredRows> GatherMasks(
      absl::Span<const int64_t> rows) const;

  // The request's outputs, `slice`, resolved for `tenant`. INVALID_ARGUMENT
  // when it is a region on another device than the step's, or overlaps one
  // of the batch's tensors (the results are written while the batch is read),
  // naming it; the region errors of RegionRegistry::Resolve.
  absl::StatusOr<ResolvedSlice> ResolveOutputs(const v1::RegionSlice& slice,
                                               const RequestDecoder& decoder,
                                               const Tenant& tenant) const;

 private:
  StepBatch() = default;
  // The batch's tensors with their fields' names: the mask, the inputs, the
  // segment ids.
  std::vector<std::pair<const TensorView*, std::string>> Named() const;
  absl::Status CheckDevices(const std::optional<TensorView>& loss);
  // Each `first` in host memory, viewed by its `second`: itself, or a copy
  // kept in host_copies_, every device copy waited for at once.
  absl::Status OnHost(
      absl::Span<const std::pair<const TensorView*, TensorView*>> wanted);

  DecodedCall call_;
  TensorView host_mask_;
  std::optional<TensorView> host_segment_ids_;
  std::optional<TensorView> host_loss_;
  std::vector<Buffer> host_copies_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_STEP_BATCH_H_
