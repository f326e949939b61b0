#include "kernels/torch/torch_backend.h"

#include <ATen/ATen.h>

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/torch_interop.h"
#include "kernels/backend.h"
#include "kernels/registry.h"

namespace packd {
namespace {

class TorchPlan : public MaskPlan {
 public:
  at::Tensor
      indices;  // flattened positions of active elements, int64, ascending
};

// Runs `fn`, turning a libtorch exception into INTERNAL: no exception leaves
// the backend.
template <typename Fn>
absl::Status Guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("libtorch ", what, " failed: ", e.what()));
  }
}

// [B, S, *tail] -> [B * S, *tail].
at::Tensor FlattenRows(const TensorView& view) {
  at::Tensor t = AsTensor(view);
  std::vector<int64_t> sizes(view.shape.begin() + 1, view.shape.end());
  sizes[0] = view.shape[0] * view.shape[1];
  return t.view(sizes);
}

class TorchBackend : public Backend {
 public:
  absl::string_view name() const override { return "torch"; }

  absl::StatusOr<std::unique_ptr<MaskPlan>> Plan(const TensorView& mask,
                                                 const Stream&) override {
    auto plan = std::make_unique<TorchPlan>();
    plan->batch = mask.shape[0];
    plan->seq = mask.shape[1];
    absl::Status status = Guarded("nonzero", [&] {
      const at::Tensor active = AsTensor(mask).ne(0);
      plan->indices = active.flatten().nonzero().squeeze(1);
      const at::Tensor counts = active.sum(1, /*keepdim=*/false, at::kLong);
      plan->cu_seqlens.assign(plan->batch + 1, 0);
      plan->last_index.assign(plan->batch, -1);
      const int64_t* c = counts.data_ptr<int64_t>();
      for (int64_t b = 0; b < plan->batch; ++b) {
        plan->cu_seqlens[b + 1] = plan->cu_seqlens[b] + c[b];
      }
      const int64_t* idx = plan->indices.data_ptr<int64_t>();
      for (int64_t k = 0; k < plan->indices.numel(); ++k) {
        plan->last_index[idx[k] / plan->seq] = idx[k] % plan->seq;
      }
    });
    if (!status.ok()) return status;
    return plan;
  }

  absl::Status PackedPositions(const MaskPlan& base,
                               std::vector<int64_t>* positions,
                               const Stream&) override {
    const auto& plan = static_cast<const TorchPlan&>(base);
    const int64_t* idx = plan.indices.data_ptr<int64_t>();
    positions->assign(idx, idx + plan.indices.numel());
    return absl::OkStatus();
  }

  absl::Status Gather(const MaskPlan& base, const TensorView& x,
                      const TensorView& out, const Stream&) override {
    const auto& plan = static_cast<const TorchPlan&>(base);
    if (plan.total_active() == 0) return absl::OkStatus();
    return Guarded("index_select", [&] {
      at::Tensor dst = AsTensor(out);
      if (plan.all_active()) {
        dst.copy_(FlattenRows(x));
      } else {
        at::index_select_out(dst, FlattenRows(x), 0, plan.indices);
      }
    });
  }

  absl::Status Scatter(const MaskPlan& base, const TensorView& packed,
                       const TensorView& dense, const Stream&) override {
    const auto& plan = static_cast<const TorchPlan&>(base);
    return Guarded("index_copy_", [&] {
      at::Tensor dst = FlattenRows(dense);
      if (plan.all_active() && plan.total_active() > 0) {
        dst.copy_(AsTensor(packed));
        return;
      }
      dst.zero_();
      if (plan.total_active() > 0)
        dst.index_copy_(0, plan.indices, AsTensor(packed));
    });
  }

  // Layouts with torch's own index ops, on integer views of the bits (so
  // that NaN payloads and -0.0 move unchanged).
  absl::Status GatherRows(const TensorView& x, absl::Span<const int64_t> rows,
                          const unsigned char* pad, const TensorView& out,
                          const Stream&) override {
    if (rows.empty() || out.nbytes() == 0) return absl::OkStatus();
    return Guarded("index_select", [&] {
      const at::Tensor index =
          at::from_blob(const_cast<int64_t*>(rows.data()),
                        {static_cast<int64_t>(rows.size())}, at::kLong);
      at::Tensor dst = Bits(AsTensor(out));
      const at::Tensor src = Bits(FlattenRows(x));
      if (src.size(0) > 0) {
        at::index_select_out(dst, src, 0, index.clamp_min(0));
      }
      const at::Tensor pads = index.lt(0);
      TensorView element;
      element.data = const_cast<unsigned char*>(pad);
      element.dtype = x.dtype;
      dst.index_put_({pads}, Bits(AsTensor(element)));
    });
  }

  absl::Status ScatterRows(const TensorView& packed,
                           absl::Span<const int64_t> rows,
                           const TensorView& dense, const Stream&) override {
    return Guarded("index_copy_", [&] {
      at::Tensor dst = Bits(FlattenRows(dense));
      dst.zero_();
      if (rows.empty()) return;
      const at::Tensor index =
          at::from_blob(const_cast<int64_t*>(rows.data()),
                        {static_cast<int64_t>(rows.size())}, at::kLong);
      const at::Tensor real = index.ge(0);
      dst.index_copy_(0, index.masked_select(real),
                      Bits(AsTensor(packed)).index({real}));
    });
  }

 private:
  // The same bytes as an integer tensor of the element's width.
  static at::Tensor Bits(const at::Tensor& t) {
    switch (t.element_size()) {
      case 1:
        return t.view(at::kByte);
      case 2:
        return t.view(at::kShort);
      case 4:
        return t.view(at::kInt);
      default:
        return t.view(at::kLong);
    }
  }
};

}  // namespace

void RegisterTorchBackends(Registry& registry) {
  registry.Add(DeviceKind::kCpu, std::make_unique<TorchBackend>())
      .IgnoreError();
}

}  // namespace packd
