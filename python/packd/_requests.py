"""The PackRequest and ScatterRequest of a call, built the same way on every path: each tensor
added by the path's encoder (its bytes or a shared-memory slice on the host, a device-region
slice on a GPU). A step's batch is a PackRequest too."""
from typing import Callable, Optional, Sequence

import torch

from packd import _wire
from packd.layout import Layout
from packd.v1 import pack_service_pb2 as pb

# encode(tensor, field number, outgoing): adds the tensor as that field.
Encoder = Callable[[torch.Tensor, int, _wire.Outgoing], None]


def _add_tensors(encode: Encoder, out: _wire.Outgoing, mask: torch.Tensor,
                 tensors: Sequence[torch.Tensor], segment_ids: Optional[torch.Tensor]) -> None:
    """The tensor fields PackRequest and ScatterRequest share the numbers of: mask (1), the
    inputs or packed tensors (2), segment ids (6)."""
    encode(mask, 1, out)
    for t in tensors:
        encode(t, 2, out)
    if segment_ids is not None:
        encode(segment_ids, 6, out)


def pack_request(encode: Encoder, device: str, with_position_ids: bool, layout: Layout,
                 mask: torch.Tensor, tensors: Sequence[torch.Tensor],
                 segment_ids: Optional[torch.Tensor]) -> _wire.Outgoing:
    out = _wire.Outgoing(pb.PackRequest(device=device, with_position_ids=with_position_ids))
    layout.to_pack(out.message)
    _add_tensors(encode, out, mask, tensors, segment_ids)
    return out


def scatter_request(encode: Encoder, device: str, layout: Layout,
                    tail_shape: Optional[Sequence[int]], mask: torch.Tensor,
                    tensors: Sequence[torch.Tensor],
                    segment_ids: Optional[torch.Tensor]) -> _wire.Outgoing:
    out = _wire.Outgoing(pb.ScatterRequest(device=device))
    layout.to_scatter(out.message)
    _add_tensors(encode, out, mask, tensors, segment_ids)
    if tail_shape is not None:
        out.message.tail_shape.dims.extend(list(tail_shape))
    return out
