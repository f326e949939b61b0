"""Pack with a gradient: the one autograd Function of packd's ops (RemotePackOp, the
flash-attention drop-in's unpads). Forward packs through the client; backward scatters the
gradient of the first input through it, with the same layout. Autograd Functions return tensors
only, so the call's whole PackResult leaves forward through a list beside them."""
from typing import Any, Dict, Optional, Sequence

import torch

from packd.results import PackResult


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, segment_ids, client, extra, pack_kwargs, scatter_kwargs, results):
        result = client.pack([x] + list(extra), mask, segment_ids=segment_ids, **pack_kwargs)
        results.append(result)
        ctx.client = client
        ctx.scatter_kwargs = scatter_kwargs
        ctx.tail_shape = tuple(x.shape[2:])
        ctx.save_for_backward(mask, segment_ids)
        others = result.packed[1:]
        ctx.mark_non_differentiable(result.cu_seqlens, *others)
        return (result.packed[0], result.cu_seqlens, *others)

    @staticmethod
    def backward(ctx, grad_packed, *_grads):
        mask, segment_ids = ctx.saved_tensors
        # On the GPU the batch came from: autograd makes the gradient where the loss is.
        grad = ctx.client.to_device_of(grad_packed.contiguous(), mask)
        grad_x = ctx.client.scatter(grad, mask, tail_shape=ctx.tail_shape,
                                    segment_ids=segment_ids, **ctx.scatter_kwargs)
        return grad_x, None, None, None, None, None, None, None


def pack_with_grad(client: Any, x: torch.Tensor, mask: torch.Tensor,
                   segment_ids: Optional[torch.Tensor] = None,
                   extra: Sequence[torch.Tensor] = (),
                   pack_kwargs: Optional[Dict[str, Any]] = None,
                   scatter_kwargs: Optional[Dict[str, Any]] = None) -> PackResult:
    """client.pack([x, *extra], mask, segment_ids=..., **pack_kwargs) whose packed[0] is
    differentiable in x: its backward is client.scatter(..., **scatter_kwargs), the gradient of
    that Pack. `extra` are packed alongside, without a gradient."""
    results = []
    outputs = _Pack.apply(x, mask, segment_ids, client, tuple(extra), pack_kwargs or {},
                          scatter_kwargs or {}, results)
    result = results[0]
    result.packed = [outputs[0]] + list(outputs[2:])
    return result
