"""RemotePackOp: the pack op (`packed, cu_seqlens = pack(x, mask)`), run by packd and
differentiable: backward scatters the gradient through packd, with the same layout."""
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from packd._autograd import pack_with_grad
from packd.client import Client
from packd.layout import Layout
from packd.results import PackResult


class RemotePackOp:
    """`op(x, mask)` -> `(packed, cu_seqlens)`: x [B, S, *tail], mask [B, S] (bool or numeric,
    nonzero active), packed [total_active, *tail] in row-major order, cu_seqlens int64 [B + 1].
    Differentiable in x. `op.unpack(packed, mask, tail_shape=None)` is the inverse, zeros at
    inactive rows. CUDA tensors stay on their GPU, forward and backward (docs/gpu.md).

    layout (a packd.Layout or its fields as a dict): every call packs with it (padding, CP
    slices, fixed shapes, shifts), and backward scatters with the same layout.
    `op.pack(x, mask, segment_ids=None)` returns the whole PackResult, its `packed`
    differentiable.

    Malformed input raises ValueError with the server's message; transport failures raise
    packd.PackdError carrying the gRPC code."""

    def __init__(self, address_or_client: Union[str, Client] = "127.0.0.1:50051", *,
                 layout: Union[Layout, Dict[str, Any], None] = None, **kwargs: Any) -> None:
        self.client = (address_or_client if isinstance(address_or_client, Client)
                       else Client(address_or_client, **kwargs))
        self.layout = layout if isinstance(layout, Layout) else Layout(**(layout or {}))

    def pack(self, x: torch.Tensor, mask: torch.Tensor,
             segment_ids: Optional[torch.Tensor] = None,
             with_position_ids: bool = False) -> PackResult:
        result = pack_with_grad(
            self.client, x, mask, segment_ids,
            pack_kwargs=dict(with_position_ids=with_position_ids, layout=self.layout),
            scatter_kwargs=dict(layout=self.layout))
        result.packed = result.packed[0]
        return result

    def __call__(self, x: torch.Tensor, mask: torch.Tensor,
                 segment_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        result = self.pack(x, mask, segment_ids)
        return result.packed, result.cu_seqlens

    def unpack(self, packed: torch.Tensor, mask: torch.Tensor,
               tail_shape: Optional[Sequence[int]] = None,
               segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.client.scatter(packed, mask, tail_shape=tail_shape, segment_ids=segment_ids,
                                   layout=self.layout)

    def close(self) -> None:
        self.client.close()
