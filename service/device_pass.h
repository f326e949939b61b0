// DevicePass: a training step's micro-batches packed on the GPU in one pass
// over the batch's device tensors (docs/design.md §12), in two waves: the
// first micro-batch alone, so that it is sent soon, then every other one. The
// host works out each micro-batch's metadata and where each of its result
// rows comes from (a Pack of the rows' dense positions, with the layout); the
// rows become spans of bytes (AppendRowSpans), one table for the wave, copied
// to the device once; then one kernel per result of the batch (each input,
// each shift) copies every micro-batch's rows of the wave from the batch's
// tensors, in place, into the outputs (or into device memory read back in one
// copy), and the host waits once.
//
// clang-format off
//   if (DevicePass::Applies(batch, spec, outputs, output_bytes)) {
//     pass.emplace(batch, spec, values, sent, outputs, output_bytes);
//   }
//   PACKD_RETURN_IF_ERROR(pass->Message(k, &packed, base, written));
// clang-format on
#ifndef PACKD_SERVICE_DEVICE_PASS_H_
#define PACKD_SERVICE_DEVICE_PASS_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/buffer.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "packd/v1/pack_service.pb.h"
#include "service/call_spec.h"
#include "service/step_batch.h"
#include "service/step_parts.h"

namespace packd {

// Safe to share across threads: the waves run once each, under a lock, and
// each micro-batch's message reads only what its own wave wrote.
class DevicePass {
 public:
  // Inline, the pass holds every result in host memory until it is sent: a
  // step with more results than this is packed a micro-batch at a time.
  static constexpr int64_t kInlineBytes = int64_t{256} << 20;

  // Whether a step runs the pass: every tensor of `batch` on its GPU, no
  // mrope, and `outputs` on that device, or none and at most kInlineBytes of
  // results.
  static bool Applies(const StepBatch& batch, const CallSpec& spec,
                      const ResolvedSlice* outputs, int64_t output_bytes);

  // The pass over `sent` (placed in `output_bytes` of results by
  // PlaceMicroBatches), writing into `outputs` (device memory of the batch's
  // device, at least output_bytes) or, when null, into device memory of its
  // own read back to the host. `values` are the pad values and fills of
  // spec.layout for the batch's inputs (CheckLayout). `batch`, `spec`,
  // `values` and `sent` must outlive it.
  DevicePass(const StepBatch& batch, const CallSpec& spec,
             const LayoutValues& values, absl::Span<const MicroBatchPlace> sent,
             char* outputs, int64_t output_bytes)
      : batch_(batch),
        spec_(spec),
        values_(values),
        sent_(sent),
        outputs_(outputs),
        output_bytes_(output_bytes),
        prepared_(sent.size()) {}

  // Micro-batch k's results into `packed`: its wave run the first time one
  // of its micro-batches is asked for, then its results placed where
  // `base.allocate` says (copied from the host's read-back without outputs;
  // already there with them) and described in `written`'s slices. Each k at
  // most once. The device's errors (FAILED_PRECONDITION when it is missing,
  // UNAVAILABLE once lost), every time for the wave's micro-batches.
  absl::Status Message(
      size_t k, v1::PackResponse* packed, const CallOptions& base,
      const google::protobuf::RepeatedPtrField<v1::RegionSlice>& written) const;

  // The time the waves run so far took.
  absl::Duration time() const;

 private:
  // Runs micro-batch k's wave the first time one of its micro-batches is
  // asked for; its status every time.
  absl::Status WaveOnce(size_t k) const;
  // The pass over sent micro-batches [begin, end).
  absl::Status Run(size_t begin, size_t end) const;
  // Sent micro-batch k's metadata: the host's Pack of its rows' dense
  // positions (row j of the batch's row r: r * S + s), with the layout, pad
  // rows and shift fills -1. Its packed and shifted results are the batch
  // position of every result row.
  absl::StatusOr<PackResult> PositionsOf(size_t k) const;

  const StepBatch& batch_;
  const CallSpec& spec_;
  const LayoutValues& values_;
  const absl::Span<const MicroBatchPlace> sent_;
  char* const outputs_;
  const int64_t output_bytes_;
  mutable absl::Mutex mu_;
  mutable bool run_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  mutable absl::Status status_[2] ABSL_GUARDED_BY(mu_);
  mutable absl::Duration time_ ABSL_GUARDED_BY(mu_);
  // Set by a wave, then read (each entry by the one micro-batch's message):
  // the micro-batches' metadata, and without outputs their results on the
  // device and in host memory.
  mutable std::vector<PackResult> prepared_;
  mutable Buffer device_results_, host_results_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_DEVICE_PASS_H_
