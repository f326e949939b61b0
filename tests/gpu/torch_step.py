"""The peer of packd's step on a GPU: the same step done in the trainer's own process with
torch, the way verl prepares one (its rows' lengths on the device, one trip of them to the
host, the plan on the host, one index_select per tensor and micro-batch), for the layout the
device checks time (documents, padded to a multiple, the token ids shifted, position ids).

    micro_batches = torch_step([tokens, logprobs], mask, segment_ids, pad_multiple=8,
                               shift=(0, -100), plan=lambda lengths, loss_tokens: ...)

`plan(lengths, loss_tokens)` returns the micro-batches as (rank, samples) pairs in the order
packd sends them (packd's planner, so that both ways pack the same rows: the plan is not what is
compared). Masks must be prefixes of their rows (right-padded rollouts), as verl's are.

tests/python/test_torch_step.py holds it equal to packd's step byte for byte on CPU tensors;
tests/gpu/gpu_client_check.py times the two side by side on a GPU.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch


@dataclass
class TorchMicroBatch:
    rank: int
    index: int
    samples: List[int]
    packed: List[torch.Tensor]
    shifted: torch.Tensor
    cu_seqlens: torch.Tensor         # the documents' real bounds, int64
    cu_seqlens_padded: torch.Tensor  # their padded bounds, int64
    position_ids: torch.Tensor       # counting on through each document's padding, int64


def measure(mask: torch.Tensor, segment_ids: torch.Tensor, pad_multiple: int,
            loss_mask: Optional[torch.Tensor] = None):
    """The rows as packd's step measures them, on the device with one trip to the host: each
    row's documents as (start, length), its length (its documents padded to pad_multiple) and
    its loss tokens (active in mask and loss_mask)."""
    B, S = mask.shape
    m = pad_multiple
    mask = mask.bool()
    # Each row's active count and loss tokens, and where its documents start (its first
    # position, and every active position whose id differs from the one before).
    starts = mask.clone()
    starts[:, 1:] &= segment_ids[:, 1:] != segment_ids[:, :-1]
    counted = mask if loss_mask is None else mask & loss_mask.bool()
    found = torch.cat([mask.sum(1), counted.sum(1), starts.flatten().nonzero().flatten()])
    host = found.tolist()  # the one trip to the host
    active, loss_tokens, flat_starts = host[:B], host[B:2 * B], host[2 * B:]
    documents = [[] for _ in range(B)]
    for p in flat_starts:
        documents[p // S].append(p % S)
    for b in range(B):
        s = documents[b]
        documents[b] = [(s[i], (s[i + 1] if i + 1 < len(s) else active[b]) - s[i])
                        for i in range(len(s))]
    lengths = [sum((L + m - 1) // m * m for _, L in documents[b]) for b in range(B)]
    return documents, lengths, loss_tokens


def torch_step(tensors: Sequence[torch.Tensor], mask: torch.Tensor,
               segment_ids: torch.Tensor, *, pad_multiple: int, shift: Tuple[int, float],
               plan: Callable[[List[int], List[int]], Sequence[Tuple[int, Sequence[int]]]],
               loss_mask: Optional[torch.Tensor] = None) -> List[TorchMicroBatch]:
    B, S = mask.shape
    device = mask.device
    m = pad_multiple
    documents, lengths, loss_tokens = measure(mask, segment_ids, m, loss_mask)
    flat = [t.reshape(B * S, *t.shape[2:]) for t in tensors]
    source, fill = shift
    out, index_in_rank = [], {}
    for rank, samples in plan(lengths, loss_tokens):
        # The output rows' dense positions, -1 for a pad row (and, shifted, for each
        # document's last token), and the metadata, on the host.
        rows, shifted, cu, cu_padded, positions = [], [], [0], [0], []
        for b in samples:
            for start, L in documents[b]:
                P = (L + m - 1) // m * m
                first = b * S + start
                rows += list(range(first, first + L)) + [-1] * (P - L)
                shifted += list(range(first + 1, first + L)) + [-1] * (P - L + 1)
                cu.append(cu[-1] + L)
                cu_padded.append(cu_padded[-1] + P)
                positions += range(P)
        idx = torch.tensor([rows, shifted], dtype=torch.long).to(device)
        pad = idx < 0
        safe = idx.clamp(min=0)
        packed = []
        for t in flat:
            x = t.index_select(0, safe[0])
            packed.append(x.masked_fill_(pad[0].view(-1, *[1] * (t.dim() - 1)), 0))
        y = flat[source].index_select(0, safe[1])
        y.masked_fill_(pad[1].view(-1, *[1] * (flat[source].dim() - 1)), fill)
        index = index_in_rank.get(rank, 0)
        index_in_rank[rank] = index + 1
        out.append(TorchMicroBatch(
            rank, index, list(samples), packed, y,
            torch.tensor(cu, dtype=torch.long).to(device),
            torch.tensor(cu_padded, dtype=torch.long).to(device),
            torch.tensor(positions, dtype=torch.long).to(device)))
    return out
