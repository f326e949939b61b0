// The one translation unit of the client that needs torch's autograd headers.
#include "client/autograd.h"

#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <vector>

namespace packd {
namespace {

// The forward call's error, kept with its code: torch carries only a message
// through apply().
thread_local absl::Status forward_status;

struct PackFunction : public torch::autograd::Function<PackFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& x, const at::Tensor& mask,
                            Client* client) {
    absl::StatusOr<PackedBatch> batch = client->Pack({x}, mask);
    if (!batch.ok()) forward_status = batch.status();
    TORCH_CHECK(batch.ok(), batch.status().ToString());
    ctx->save_for_backward({mask});
    ctx->saved_data["client"] = reinterpret_cast<int64_t>(client);
    ctx->saved_data["tail"] = x.sizes().slice(2).vec();
    return batch->packed[0];
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    auto* client = reinterpret_cast<Client*>(ctx->saved_data["client"].toInt());
    const at::Tensor mask = ctx->get_saved_variables()[0];
    const std::vector<int64_t> tail = ctx->saved_data["tail"].toIntVector();
    // On the GPU the batch came from: autograd makes the gradient where the
    // loss is.
    absl::StatusOr<at::Tensor> grad =
        client->ToDeviceOf(grads[0].contiguous(), mask);
    TORCH_CHECK(grad.ok(),
                "packd Scatter in backward: ", grad.status().ToString());
    absl::StatusOr<std::vector<at::Tensor>> dense =
        client->Scatter({*grad}, mask, tail);
    TORCH_CHECK(dense.ok(),
                "packd Scatter in backward: ", dense.status().ToString());
    return {(*dense)[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

absl::StatusOr<at::Tensor> PackWithGrad(Client& client, const at::Tensor& x,
                                        const at::Tensor& mask) {
  forward_status = absl::OkStatus();
  try {
    return PackFunction::apply(x, mask, &client);
  } catch (const c10::Error& e) {
    if (!forward_status.ok()) return forward_status;
    return absl::InternalError(e.what_without_backtrace());
  }
}

}  // namespace packd
