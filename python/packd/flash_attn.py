"""flash-attention's padding helpers (`flash_attn.bert_padding`, flash-attn >= 2.6), run by packd.

    from packd import flash_attn as bert_padding   # instead of flash_attn.bert_padding

    hidden_unpad, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(
        hidden_states, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    hidden = bert_padding.pad_input(out, indices, batch, seqlen)

Each function returns what flash-attn's returns, with the same dtypes (indices int64 over the
flattened B * S positions, cu_seqlens int32 [B + 1], max_seqlen a Python int, seqused int32
[B]), and is differentiable: the backward of an unpad is a packd Scatter, of a pad a packd Pack.
CPU and CUDA tensors both work (a CUDA tensor stays on its GPU, docs/gpu.md).

One deliberate difference: flash-attn counts `attention_mask.sum()`, so a mask holding a 2
counts that position twice in cu_seqlens while its indices hold it once. packd counts nonzero
positions (docs/design.md §1), so cu_seqlens always agrees with indices. With 0/1 masks, the
only masks flash-attn documents, the results are identical.

The calls go to the client given as `client=`, else to the one set with `set_client()`, else to
a client of the address in $PACKD_ADDRESS (default 127.0.0.1:50051), made on first use."""
from typing import Optional, Tuple

import torch

from packd import _default
from packd._autograd import pack_with_grad
from packd._default import set_client
from packd.client import Client

__all__ = ["pad_input", "set_client", "unpad_input", "unpad_input_for_concatenated_sequences"]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each position's index in the flattened batch, where the mask is."""
    B, S = mask.shape
    return torch.arange(B * S, dtype=torch.int64, device=mask.device).view(B, S)


def _unpad(hidden, mask, segment_ids, client):
    """(hidden[mask != 0], its flattened indices, the PackResult): differentiable in hidden,
    the backward a Scatter."""
    positions = client.to_device_of(_positions(mask), hidden)
    result = pack_with_grad(client, hidden, mask, segment_ids, extra=[positions],
                            pack_kwargs=dict(cu_seqlens_dtype=torch.int32))
    return result.packed[0], result.packed[1], result


class _Pad(torch.autograd.Function):
    """hidden [N, *tail] placed at `mask` of [B, S]: zeros elsewhere; backward packs."""

    @staticmethod
    def forward(ctx, hidden, mask, client):
        ctx.client = client
        ctx.save_for_backward(mask)
        return client.scatter(hidden.contiguous(), mask, tail_shape=tuple(hidden.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        grad = ctx.client.to_device_of(grad.contiguous(), mask)
        return ctx.client.pack(grad, mask).packed, None, None


def _check_mask(name: str, mask: torch.Tensor, hidden: torch.Tensor) -> None:
    if mask.dim() != 2 or hidden.dim() < 2 or tuple(hidden.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"{name} must be [batch, seqlen] and hidden_states [batch, seqlen, ...]:"
                         f" got {tuple(mask.shape)} and {tuple(hidden.shape)}")


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None, *, client: Optional[Client] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """hidden_states [B, S, ...], attention_mask [B, S] (nonzero: a token), unused_mask [B, S]
    or None (tokens that are allocated but unused: packed, yet not counted in seqused).

    Returns (hidden_states [total, ...], indices int64 [total] into the flattened B * S
    positions, cu_seqlens int32 [B + 1], max_seqlen_in_batch int, seqused int32 [B]: the tokens
    of attention_mask alone in each row)."""
    _check_mask("attention_mask", attention_mask, hidden_states)
    client = _default.resolve(client)
    used = attention_mask != 0
    every = used if unused_mask is None else used | (unused_mask != 0)
    # A mask derived here is where hidden_states is; where torch cannot tell (device memory
    # of the client's own), the client moves it there.
    packed, indices, result = _unpad(hidden_states, client.to_device_of(every, hidden_states),
                                     None, client)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    return packed, indices, result.cu_seqlens, result.max_seqlen, seqused


def unpad_input_for_concatenated_sequences(
        hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor, *,
        client: Optional[Client] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Several sequences concatenated in each row: attention_mask_in_length [B, S] holds, in
    each row, the lengths of its sequences in order, then zeros (e.g. [2, 3, 0, 0, 0, 0]: a
    sequence of 2, then one of 3, then padding). Zeros between lengths are skipped.

    Returns (hidden_states [total, ...], indices int64 [total], cu_seqlens int32 over every
    sequence of every row [sequences + 1], max_seqlen_in_batch int)."""
    _check_mask("attention_mask_in_length", attention_mask_in_length, hidden_states)
    lengths = attention_mask_in_length.to(torch.int64)
    B, S = lengths.shape
    ends = lengths.cumsum(dim=-1)  # each row's sequence ends
    positions = torch.arange(S, dtype=torch.int64, device=lengths.device).expand(B, S)
    mask = positions < ends[:, -1:]
    # A position's sequence: how many ends lie at or before it.
    segment_ids = torch.searchsorted(ends.contiguous(), positions.contiguous(), right=True)
    client = _default.resolve(client)
    packed, indices, result = _unpad(
        hidden_states, client.to_device_of(mask, hidden_states),
        client.to_device_of(segment_ids.to(torch.int32), hidden_states), client)
    return packed, indices, result.doc_cu_seqlens.to(torch.int32), result.doc_max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int, *,
              client: Optional[Client] = None) -> torch.Tensor:
    """The inverse of unpad_input: hidden_states [total, ...] placed at `indices` of a
    [batch, seqlen, ...] tensor of zeros. Indices in increasing order (as unpad_input returns
    them) go through packd; any others are placed by torch, with the same result."""
    if indices.dim() != 1 or hidden_states.dim() < 1 or hidden_states.shape[0] != indices.numel():
        raise ValueError(f"indices must be [total] and hidden_states [total, ...]: got "
                         f"{tuple(indices.shape)} and {tuple(hidden_states.shape)}")
    indices = indices.to(device=hidden_states.device, dtype=torch.int64)
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
        out[indices] = hidden_states
        return out.view(batch, seqlen, *hidden_states.shape[1:])
    client = _default.resolve(client)
    mask = torch.zeros(batch * seqlen, dtype=torch.bool, device=hidden_states.device)
    mask[indices] = True
    return _Pad.apply(hidden_states, client.to_device_of(mask.view(batch, seqlen), hidden_states),
                      client)
