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


def rows_of(t, rows):
    """t[rows], or t itself for rows None."""
    return t if rows is None else t[rows]


def by_rows(mask, tensors):
    """Whether a call can go in parts of the rows: every tensor [B, S, ...] like the [B, S]
    mask, with B >= 2."""
    return (mask.dim() == 2 and mask.shape[0] >= 2
            and all(t.dim() >= 2 and t.shape[:2] == mask.shape for t in tensors))


def part_bounds(rows, parts):
    """The first row of each of `parts` parts of `rows` rows, and `rows`."""
    return [rows * k // parts for k in range(parts + 1)]


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
