"""RemotePackOp: the seeds' pack op (`packed, cu_seqlens = pack(x, mask)`), run by packd and
differentiable: backward scatters the gradient through packd."""
from typing import Optional, Sequence, Union

import torch

from packd.client import Client


class _PackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, client):
        result = client.pack(x, mask)
        ctx.client = client
        ctx.tail_shape = tuple(x.shape[2:])
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(result.cu_seqlens)
        return result.packed, result.cu_seqlens

    @staticmethod
    def backward(ctx, grad_packed, _grad_cu_seqlens):
        (mask,) = ctx.saved_tensors
        # On the GPU the batch came from: autograd makes the gradient where the loss is.
        grad = ctx.client.to_device_of(grad_packed.contiguous(), mask)
        grad_x = ctx.client.scatter(grad, mask, tail_shape=ctx.tail_shape)
        return grad_x, None, None


class RemotePackOp:
    """`op(x, mask)` -> `(packed, cu_seqlens)`: x [B, S, *tail], mask [B, S] (bool or numeric,
    nonzero active), packed [total_active, *tail] in row-major order, cu_seqlens int64 [B + 1].
    Differentiable in x. `op.unpack(packed, mask, tail_shape=None)` is the inverse, zeros at
    inactive rows. CUDA tensors stay on their GPU, forward and backward (docs/gpu.md).

    Malformed input raises ValueError with the server's message; transport failures raise
    packd.PackdError carrying the gRPC code."""

    def __init__(self, address_or_client: Union[str, Client] = "127.0.0.1:50051", **kwargs):
        self.client = (address_or_client if isinstance(address_or_client, Client)
                       else Client(address_or_client, **kwargs))

    def __call__(self, x: torch.Tensor, mask: torch.Tensor):
        return _PackFunction.apply(x, mask, self.client)

    def unpack(self, packed: torch.Tensor, mask: torch.Tensor,
               tail_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        return self.client.scatter(packed, mask, tail_shape=tail_shape)

    def close(self):
        self.client.close()
