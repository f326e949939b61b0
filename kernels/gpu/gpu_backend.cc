#include "kernels/gpu/gpu_backend.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/gpu/gpu_device_runtime.h"
#include "kernels/gpu/gpu_kernels.h"
#include "kernels/gpu/gpu_runtime.h"
#include "kernels/gpu/gpu_status.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"

namespace packd::PACKD_GPU_NS {
namespace {

class GpuPlan : public MaskPlan {
 public:
  MaskScan scan{};
  // On the device: the scan's arrays (MakeMaskScan).
  Buffer work;
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
    const MaskScan& scan = plan->scan;
    PACKD_GPU_CHECK("mask scan launch",
                    LaunchMaskScan(scan, NativeStream(stream)));
    // The one synchronisation of a call: cu_seqlens and last_index (adjacent
    // on the device) to the host.
    std::vector<int64_t> meta(2 * B + 1);
    PACKD_RETURN_IF_ERROR(runtime_->CopyToHost(
        meta.data(), scan.cu_seqlens, meta.size() * sizeof(int64_t), stream));
    plan->cu_seqlens.assign(meta.begin(), meta.begin() + B + 1);
    plan->last_index.assign(meta.begin() + B + 1, meta.end());
    return plan;
  }

  absl::Status PackedPositions(const MaskPlan& base,
                               std::vector<int64_t>* positions,
                               const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    positions->resize(plan.total_active());
    return runtime_->CopyToHost(positions->data(), plan.scan.index,
                                positions->size() * sizeof(int64_t), stream);
  }

  absl::Status Gather(const MaskPlan& base, const TensorView& x,
                      const TensorView& out, const Stream& stream) override {
    const auto& plan = static_cast<const GpuPlan&>(base);
    const int64_t total = plan.total_active();
    if (total == 0 || out.nbytes() == 0) return absl::OkStatus();
    PACKD_GPU_CHECK("set device", gpuSetDevice(x.device.index));
    if (plan.all_active()) {
      PACKD_GPU_CHECK("copy", gpuMemcpyAsync(out.data, x.data, out.nbytes(),
                                             gpuMemcpyDeviceToDevice,
                                             NativeStream(stream)));
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
      PACKD_GPU_CHECK("zero fill", gpuMemsetAsync(dense.data, 0, dense.nbytes(),
                                                  NativeStream(stream)));
      return absl::OkStatus();
    }
    if (plan.all_active()) {
      PACKD_GPU_CHECK(
          "copy",
          gpuMemcpyAsync(dense.data, packed.data, dense.nbytes(),
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

 private:
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
