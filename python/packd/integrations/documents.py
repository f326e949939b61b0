"""A packed row's documents, as every adapter of packd's finds and masks them (written once
here: packd_varlen, the per-document stateful layers, the leak probe and packed_row use it).

- Where the documents are: `sequence_bounds` (from `cu_seq_lens_q`, else position ids that
  restart: `restarts`), and what packd.hf.packed_row declared (`declared_sequences`,
  `undeclared`), so that a forward in which neither reached a layer is refused.
- What a query sees: `pattern` (transformers' causal and sliding-window rules, aligned
  bottom-right), and masks converted between transformers' two forms (`allowed_of`: additive or
  boolean to boolean; `additive_of`: boolean to additive in a dtype)."""
import contextlib
import contextvars
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch


class Declared:
    """A packed row's sequences as packd.hf.packed_row declared them ([start, end) of one
    row), and where packd_varlen found them in each call since (`sources`)."""

    def __init__(self, bounds: Sequence[Tuple[int, int]]) -> None:
        self.bounds = [(int(s), int(e)) for s, e in bounds if e > s]
        self.sources: List[str] = []


_declared: contextvars.ContextVar[Optional[Declared]] = contextvars.ContextVar(
    "packd_varlen_declared", default=None)


def declaration() -> Optional[Declared]:
    """What packed_row declared of the row being forwarded now, if anything."""
    return _declared.get()


@contextlib.contextmanager
def declared_sequences(bounds: Sequence[Tuple[int, int]]) -> Iterator[Declared]:
    """While open, packd_varlen knows a one-row batch of bounds[-1][1] tokens holds these
    sequences, and refuses a forward in which none of its sources found them."""
    declared = Declared(bounds)
    token = _declared.set(declared)
    try:
        yield declared
    finally:
        _declared.reset(token)


def restarts(positions: torch.Tensor) -> torch.Tensor:
    """Where each row's documents start, from its position ids [B, T]: the first token, and
    wherever a position is not the one before it plus 1 (transformers' own rule). bool [B, T]."""
    starts = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def undeclared(found: Optional[Sequence[Tuple[int, int]]], length: int) -> List[int]:
    """The starts of the sequences packd.hf.packed_row declared for a row of `length` tokens
    that `found` (a row's [start, end) bounds; None: the row whole) does not have; [] when
    nothing was declared for such a row."""
    declared = _declared.get()
    if declared is None or declared.bounds[-1][1] != length:
        return []
    starts = {s for s, _ in found or [(0, length)]}
    return [s for s, _ in declared.bounds if s not in starts]


def _bounds_of_edges(edges: List[int], length: int, what: str) -> List[Tuple[int, int]]:
    if (not edges or edges[0] != 0 or edges[-1] != length
            or any(b < a for a, b in zip(edges, edges[1:]))):
        raise ValueError("packd_varlen: %s %s does not cover the row's %d tokens in order"
                         % (what, edges, length))
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def sequence_bounds(batch: int, length: int,
                    kwargs: Dict[str, Any]) -> Optional[List[List[Tuple[int, int]]]]:
    """Each row's sequences as [start, end) in order, covering the row: from `cu_seq_lens_q`
    (one row), else from `position_ids` (a sequence starts wherever a position is not the one
    before it plus 1, as transformers finds packed sequences); None when neither is given."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = None if kwargs.get("kv_index") is not None else kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu()):
            raise ValueError("packd_varlen: cu_seq_lens_k differs from cu_seq_lens_q; queries "
                             "and keys of one sequence must be the same tokens")
        if batch != 1:
            raise ValueError("packd_varlen: cu_seq_lens_q describes one packed row, but the "
                             "batch has %d rows" % batch)
        return [_bounds_of_edges([int(v) for v in cu.tolist()], length, "cu_seq_lens_q")]
    positions = kwargs.get("position_ids")
    if positions is None:
        return None
    if positions.dim() == 3:  # multimodal rotary positions [3 or 4, B, T]: the text row
        positions = positions[0]
    if positions.shape[-1] != length:
        return None  # a cache's positions: the queries are not the whole row
    starts = restarts(positions.reshape(-1, length).expand(batch, length).cpu())
    rows = []
    for b in range(batch):
        edges = starts[b].nonzero().flatten().tolist() + [length]
        rows.append(list(zip(edges, edges[1:])))
    return rows


def pattern(lq: int, lk: int, causal: bool, sliding_window: Optional[int],
            device: Any) -> torch.Tensor:
    """Which keys each query sees without a mask, transformers' rules, aligned bottom-right
    (query i at key i + lk - lq: a cache's keys, or a shared prompt, before the queries): when
    causal, the keys up to it and fewer than sliding_window back; when not, every key within
    sliding_window on either side. bool [lq, lk]."""
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if sliding_window:
        allowed &= i - j < sliding_window if causal else (i - j).abs() <= sliding_window
    return allowed


def allowed_of(mask: torch.Tensor) -> torch.Tensor:
    """A transformers attention mask, boolean or additive (the dtype's minimum where masked),
    as booleans: True where a query sees a key."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min


def additive_of(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as transformers' additive one in `dtype`: 0 where seen, the dtype's
    minimum where not."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)
