// The one translation unit of the client that needs torch's autograd headers.
#include "client/autograd.h"

#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <vector>

#include "proto/tensor_codec.h"

namespace packd {
namespace {

// The forward call's error, kept with its code: torch carries only a message
// through apply().
thread_local absl::Status forward_status;

struct PackFunction : public torch::autograd::Function<PackFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& x, const at::Tensor& mask,
                            const at::Tensor* segment_ids, Client* client,
                            const LayoutOptions* layout) {
    PackCallOptions options;
    options.layout = *layout;
    options.segment_ids = *segment_ids;
    absl::StatusOr<PackedBatch> batch = client->Pack({x}, mask, options);
    if (!batch.ok()) forward_status = batch.status();
    TORCH_CHECK(batch.ok(), batch.status().ToString());
    ctx->save_for_backward({mask});
    // Not an input of the op (autograd takes no undefined tensor there).
    if (segment_ids->defined()) ctx->saved_data["segment_ids"] = *segment_ids;
    ctx->saved_data["client"] = reinterpret_cast<int64_t>(client);
    ctx->saved_data["tail"] = x.sizes().slice(2).vec();
    // What Scatter takes of the layout (every field that places rows), kept
    // as the wire encodes it: one codec, so no field is left behind.
    v1::ScatterRequest kept;
    const absl::Status encoded = EncodeLayout(ScatterFields(*layout), &kept);
    TORCH_CHECK(encoded.ok(), encoded.ToString());
    ctx->saved_data["layout"] = kept.SerializeAsString();
    return batch->packed[0];
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    auto* client = reinterpret_cast<Client*>(ctx->saved_data["client"].toInt());
    const at::Tensor mask = ctx->get_saved_variables()[0];
    ScatterCallOptions options;
    if (ctx->saved_data.count("segment_ids") > 0) {
      options.segment_ids = ctx->saved_data["segment_ids"].toTensor();
    }
    options.tail_shape = ctx->saved_data["tail"].toIntVector();
    v1::ScatterRequest kept;
    TORCH_CHECK(kept.ParseFromString(ctx->saved_data["layout"].toStringRef()),
                "packd Scatter in backward: the saved layout does not parse");
    options.layout = DecodeLayout(kept);
    // On the GPU the batch came from: autograd makes the gradient where the
    // loss is.
    absl::StatusOr<at::Tensor> grad =
        client->ToDeviceOf(grads[0].contiguous(), mask);
    TORCH_CHECK(grad.ok(),
                "packd Scatter in backward: ", grad.status().ToString());
    absl::StatusOr<std::vector<at::Tensor>> dense =
        client->Scatter({*grad}, mask, options);
    TORCH_CHECK(dense.ok(),
                "packd Scatter in backward: ", dense.status().ToString());
    return {(*dense)[0], at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

absl::StatusOr<at::Tensor> PackWithGrad(Client& client, const at::Tensor& x,
                                        const at::Tensor& mask) {
  return PackWithGrad(client, x, mask, LayoutOptions());
}

absl::StatusOr<at::Tensor> PackWithGrad(Client& client, const at::Tensor& x,
                                        const at::Tensor& mask,
                                        const LayoutOptions& layout,
                                        const at::Tensor& segment_ids) {
  forward_status = absl::OkStatus();
  try {
    return PackFunction::apply(x, mask, &segment_ids, &client, &layout);
  } catch (const c10::Error& e) {
    if (!forward_status.ok()) return forward_status;
    return absl::InternalError(e.what_without_backtrace());
  }
}

}  // namespace packd
