#include "kernels/gpu/gpu_backend.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device_staging.h"
#include "kernels/gpu/gpu_device_runtime.h"
#include "kernels/gpu/gpu_kernels.h"
#include "kernels/gpu/gpu_runtime.h"
#include "kernels/gpu/gpu_status.h"
#include "kernels/registry.h"

namespace packd::PACKD_GPU_NS {
namespace {

class GpuPlan : public MaskPlan {
 public:
  MaskScan scan{};
  // On the device: the scan's arrays (MakeMaskScan).
  Buffer work;
  // ScanAhead's: cu_seqlens and last_index as they reach host memory.
  Buffer meta;
  // Every packed token's dense position, once brought to the host
  // (Documents, PackedPositions).
  mutable std::vector<int64_t> positions;
  mutable bool have_positions = false;
};

class GpuBackend : public Backend {
 public:
  explicit GpuBackend(DeviceRuntime* runtime) : runtime_(runtime) {}
  absl::string_view name() const override {
#if defined(PACKD_GPU_FAKE)
    return "fake-gpu";
#else
    return "gpu";
#endif
  }

  absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(
      const TensorView& mask, const Stream& stream) override {
    PACKD_ASSIGN_OR_RETURN(std::unique_ptr<GpuPlan> plan, Scan(mask, stream));
    // The call's round trip: cu_seqlens and last_index (adjacent on the
    // device) to the host.
    const int64_t B = plan->batch;
    std::vector<int64_t> meta(2 * B + 1);
    PACKD_RETURN_IF_ERROR(
        runtime_->CopyToHost(meta.data(), plan->scan.cu_seqlens,
                             meta.size() * sizeof(int64_t), stream));
    plan->cu_seqlens.assign(meta.begin(), meta.begin() + B + 1);
    plan->last_index.assign(meta.begin() + B + 1, meta.end());
    return plan;
  }

  absl::StatusOr<std::unique_ptr<MaskPlan>> ScanAhead(
      const TensorView& mask, const Stream& stream) override {
    PACKD_ASSIGN_OR_RETURN(std::unique_ptr<GpuPlan> plan, Scan(mask, stream));
    const int64_t bytes = (2 * plan->batch + 1) * int64_t{sizeof(int64_t)};
    PACKD_ASSIGN_OR_RETURN(plan->meta,
                           runtime_->AllocateHost(bytes, mask.device));
    PACKD_RETURN_IF_ERROR(
        runtime_->CopyAsync(plan->meta.data(), plan->scan.cu_seqlens, bytes,
                            CopyDirection::kDeviceToHost, stream));
    return plan;
  }

  void FinishScan(MaskPlan* base) override {
    auto* plan = static_cast<GpuPlan*>(base);
    const auto* meta = static_cast<const int64_t*>(plan->meta.data());
    const int64_t B = plan->batch;
    plan->cu_seqlens.assign(meta, meta + B + 1);
    plan->last_index.assign(meta + B + 1, meta + 2 * B + 1);
  }

  absl::Status GatherCounted(const MaskPlan& base, const TensorView& x,
                             void* out, const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t positions = plan.batch * plan.seq;
    if (positions == 0 || x.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(x.device.index));
    PACKD_GPU_CHECK("gather launch",
                    LaunchGather(x.data, out, plan.scan.index, positions,
                                 x.nbytes() / positions, NativeStream(stream),
                                 /*count=*/plan.scan.cu_seqlens + plan.batch));
    return absl::OkStatus();
  }

  absl::Status PackedPositions(const MaskPlan& base,
                               std::vector<int64_t>* positions,
                               const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    if (!plan.have_positions) {
      plan.positions.resize(plan.total_active());
      PACKD_RETURN_IF_ERROR(runtime_->CopyToHost(
          plan.positions.data(), plan.scan.index,
          plan.positions.size() * sizeof(int64_t), stream));
      plan.have_positions = true;
    }
    *positions = plan.positions;
    return absl::OkStatus();
  }

  absl::Status Gather(const MaskPlan& base, const TensorView& x,
                      const TensorView& out, const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t total = plan.total_active();
    if (total == 0 || out.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(x.device.index));
    if (plan.all_active()) {
      PACKD_GPU_CHECK(
          "copy", CountedCopy(out.data, x.data, out.nbytes(),
                              gpuMemcpyDeviceToDevice, NativeStream(stream)));
      return absl::OkStatus();
    }
    PACKD_GPU_CHECK("gather launch",
                    LaunchGather(x.data, out.data, plan.scan.index, total,
                                 out.nbytes() / total, NativeStream(stream)));
    return absl::OkStatus();
  }

  absl::Status Scatter(const MaskPlan& base, const TensorView& packed,
                       const TensorView& dense, const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t positions = plan.batch * plan.seq;
    if (positions == 0 || dense.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(dense.device.index));
    const int64_t row_bytes = dense.nbytes() / positions;
    if (plan.total_active() == 0) {
      PACKD_GPU_CHECK("zero fill", CountedMemset(dense.data, 0, dense.nbytes(),
                                                 NativeStream(stream)));
      return absl::OkStatus();
    }
    if (plan.all_active()) {
      PACKD_GPU_CHECK(
          "copy", CountedCopy(dense.data, packed.data, dense.nbytes(),
                              gpuMemcpyDeviceToDevice, NativeStream(stream)));
      return absl::OkStatus();
    }
    PACKD_GPU_CHECK("zero-fill launch",
                    LaunchZeroInactive(plan.scan, dense.data, row_bytes,
                                       NativeStream(stream)));
    PACKD_GPU_CHECK("scatter launch",
                    LaunchScatterRows(packed.data, dense.data, plan.scan.index,
                                      plan.total_active(), row_bytes,
                                      NativeStream(stream)));
    return absl::OkStatus();
  }

  // Layouts: the real rows gathered into a compact buffer and scattered to
  // their output rows; pad rows likewise from one row of pad elements. Every
  // launch is the pack's or scatter's own kernel; the call's temporaries are
  // held until the stream has finished with them.
  absl::Status GatherRows(const TensorView& x, absl::Span<const int64_t> rows,
                          const unsigned char* pad, const TensorView& out,
                          const Stream& stream) override {
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0 || out.nbytes() == 0) return absl::OkStatus();
    const int64_t width = out.nbytes() / n;
    std::vector<int64_t> from, to, pads;
    for (int64_t j = 0; j < n; ++j) {
      if (rows[j] >= 0) {
        from.push_back(rows[j]);
        to.push_back(j);
      } else {
        pads.push_back(j);
      }
    }
    PACKD_GPU_CHECK("set device", gpuSetDevice(out.device.index));
    PACKD_RETURN_IF_ERROR(Move(x.data, from, to, width, out, stream));
    if (!pads.empty()) {
      // One row of pad elements, and every pad row taken from it.
      const int64_t item = ItemSize(x.dtype);
      std::vector<unsigned char> row(width);
      for (int64_t at = 0; at < width; ++at) row[at] = pad[at % item];
      PACKD_ASSIGN_OR_RETURN(void* pad_row,
                             Upload(row.data(), width, out.device, stream));
      PACKD_RETURN_IF_ERROR(Move(pad_row, std::vector<int64_t>(pads.size(), 0),
                                 pads, width, out, stream));
    }
    return absl::OkStatus();
  }

  absl::Status ScatterRows(const TensorView& packed,
                           absl::Span<const int64_t> rows,
                           const TensorView& dense,
                           const Stream& stream) override {
    if (dense.nbytes() == 0) return absl::OkStatus();
    const int64_t width = dense.nbytes() / (dense.shape[0] * dense.shape[1]);
    PACKD_GPU_CHECK("set device", gpuSetDevice(dense.device.index));
    PACKD_GPU_CHECK("zero fill", CountedMemset(dense.data, 0, dense.nbytes(),
                                               NativeStream(stream)));
    std::vector<int64_t> from, to;
    for (int64_t j = 0; j < static_cast<int64_t>(rows.size()); ++j) {
      if (rows[j] >= 0) {
        from.push_back(j);
        to.push_back(rows[j]);
      }
    }
    return Move(packed.data, from, to, width, dense, stream);
  }

  // The default's ids and positions, both brought back with one wait; the
  // positions are kept for PackedPositions.
  absl::Status Documents(const MaskPlan& base, const TensorView& segment_ids,
                         DeviceRuntime& runtime, DocumentCuts* out,
                         const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t total = plan.total_active();
    const int64_t item = ItemSize(segment_ids.dtype);
    if (total * (item + 8) > DeviceStaging::kQueuedBytes) {
      return Backend::Documents(base, segment_ids, runtime, out, stream);
    }
    std::vector<int64_t> ids(total);
    if (total > 0) {
      PACKD_ASSIGN_OR_RETURN(Buffer packed,
                             runtime_->Allocate(total * item, stream.device()));
      TensorView view;
      view.data = packed.data();
      view.dtype = segment_ids.dtype;
      view.shape = {total};
      view.device = stream.device();
      PACKD_RETURN_IF_ERROR(Gather(plan, segment_ids, view, stream));
      PACKD_ASSIGN_OR_RETURN(
          Buffer back,
          runtime_->AllocateHost(total * (item + 8), stream.device()));
      char* host = static_cast<char*>(back.data());
      PACKD_RETURN_IF_ERROR(
          runtime_->CopyAsync(host, packed.data(), total * item,
                              CopyDirection::kDeviceToHost, stream));
      PACKD_RETURN_IF_ERROR(
          runtime_->CopyAsync(host + total * item, plan.scan.index, total * 8,
                              CopyDirection::kDeviceToHost, stream));
      stream.Hold(std::move(packed));
      PACKD_RETURN_IF_ERROR(runtime_->Synchronize(stream));
      for (int64_t k = 0; k < total; ++k) {
        ids[k] = IntegerAt(host, segment_ids.dtype, k);
      }
      plan.positions.resize(total);
      std::memcpy(plan.positions.data(), host + total * item, total * 8);
    }
    plan.have_positions = true;
    CutDocuments(plan, ids, plan.positions, out);
    return absl::OkStatus();
  }

 private:
  // `bytes` of host memory in a new device buffer: the copy queued on the
  // stream through pinned memory (or, past DeviceStaging::kQueuedBytes, done
  // when it returns), both buffers held by the stream until it is
  // synchronised.
  absl::StatusOr<void*> Upload(const void* host, int64_t bytes,
                               const Device& device, const Stream& stream) {
    PACKD_ASSIGN_OR_RETURN(Buffer on_device, runtime_->Allocate(bytes, device));
    void* data = on_device.data();
    if (bytes > DeviceStaging::kQueuedBytes) {
      PACKD_RETURN_IF_ERROR(runtime_->CopyToDevice(data, host, bytes, stream));
    } else {
      PACKD_ASSIGN_OR_RETURN(Buffer pinned,
                             runtime_->AllocateHost(bytes, device));
      std::memcpy(pinned.data(), host, bytes);
      PACKD_RETURN_IF_ERROR(runtime_->CopyAsync(
          data, pinned.data(), bytes, CopyDirection::kHostToDevice, stream));
      stream.Hold(std::move(pinned));
    }
    stream.Hold(std::move(on_device));
    return data;
  }

  // out row to[k] = src row from[k] for every k, through a compact device
  // buffer; what it uses is held by the stream.
  absl::Status Move(const void* src, const std::vector<int64_t>& from,
                    const std::vector<int64_t>& to, int64_t width,
                    const TensorView& out, const Stream& stream) {
    const int64_t n = static_cast<int64_t>(from.size());
    if (n == 0) return absl::OkStatus();
    std::vector<int64_t> both(from);
    both.insert(both.end(), to.begin(), to.end());
    PACKD_ASSIGN_OR_RETURN(void* index,
                           Upload(both.data(), 2 * n * 8, out.device, stream));
    PACKD_ASSIGN_OR_RETURN(Buffer rows,
                           runtime_->Allocate(n * width, out.device));
    const int64_t* from_d = static_cast<const int64_t*>(index);
    PACKD_GPU_CHECK("gather launch", LaunchGather(src, rows.data(), from_d, n,
                                                  width, NativeStream(stream)));
    PACKD_GPU_CHECK("scatter launch",
                    LaunchScatterRows(rows.data(), out.data, from_d + n, n,
                                      width, NativeStream(stream)));
    stream.Hold(std::move(rows));
    return absl::OkStatus();
  }

  // The mask scanned on the device, its sizes not read yet.
  absl::StatusOr<std::unique_ptr<GpuPlan>> Scan(const TensorView& mask,
                                                const Stream& stream) {
    auto plan = std::make_unique<GpuPlan>();
    const int64_t B = mask.shape[0], S = mask.shape[1];
    plan->batch = B;
    plan->seq = S;
    PACKD_GPU_CHECK("set device", gpuSetDevice(mask.device.index));
    PACKD_ASSIGN_OR_RETURN(
        plan->work, runtime_->Allocate(MaskScanWords(B, S) * 8, mask.device));
    plan->scan = MakeMaskScan(
        mask.data, B, S, static_cast<int>(ItemSize(mask.dtype)),
        IsFloatingPoint(mask.dtype), static_cast<int64_t*>(plan->work.data()));
    PACKD_GPU_CHECK("mask scan launch",
                    LaunchMaskScan(plan->scan, NativeStream(stream)));
    return plan;
  }

  DeviceRuntime* const runtime_;
};

}  // namespace

void RegisterGpuBackends(Registry& registry) {
  std::unique_ptr<DeviceRuntime> runtime = MakeGpuRuntime();
  DeviceRuntime* gpu = runtime.get();  // the registry keeps it for good
  registry.SetRuntime(std::move(runtime));
  registry
      .Add(kGpuKind, std::make_unique<GpuBackend>(gpu),
           /*make_default=*/true)
      .IgnoreError();
}

}  // namespace packd::PACKD_GPU_NS
