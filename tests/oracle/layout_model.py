"""A plain-Python model of packd's layouts (docs/design.md §10) and of a training step's plan
(§12), written from the rules alone: no torch, no packd. Tensors are lists of rows, a row the
bytes of one [B, S] position; a mask is a list of lists of truth values.

    o = Options(pad_multiple=4, sp_size=2, sp_rank=1, shifts=((0, -100),))
    laid = layout(mask, segment_ids, o)     # or raises Refused("the message packd gives")
    rows = gather(x_rows, laid.rows, pad)   # the bytes packd's packed[i] must hold
"""
import dataclasses
import math
from typing import List, Optional, Sequence, Tuple


class Refused(Exception):
    """The call is INVALID_ARGUMENT; str(e) is a part of the message packd must give."""


@dataclasses.dataclass(frozen=True)
class Options:
    pad_multiple: int = 0
    pad_values: Optional[Tuple[float, ...]] = None
    cp_size: int = 0
    cp_rank: int = 0
    sp_size: int = 0
    sp_rank: int = 0
    with_seq_idx: bool = False
    shifts: Tuple[Tuple[int, float], ...] = ()
    fixed: Tuple[int, int, int] = (0, 0, 0)  # tokens, sequences, max_seqlen

    def any(self):
        return bool(self.pad_multiple or self.pad_values or self.cp_size or self.cp_rank
                    or self.sp_size or self.sp_rank or self.with_seq_idx or self.shifts
                    or any(self.fixed))

    def reshapes(self):
        return self.pad_multiple > 1 or self.cp_size > 1 or self.sp_size > 1 or any(self.fixed)


def validate(o: Options, inputs: int) -> None:
    """The rules that hold whatever the batch (§10, "Errors")."""
    for name in ("pad_multiple", "cp_size", "sp_size"):
        if getattr(o, name) < 0:
            raise Refused("%s %d is negative" % (name, getattr(o, name)))
    for name, v in zip(("tokens", "sequences", "max_seqlen"), o.fixed):
        if v < 0:
            raise Refused("fixed.%s %d is negative" % (name, v))
    if o.cp_size > 1:
        if not 0 <= o.cp_rank < o.cp_size:
            raise Refused("cp_rank %d is not in [0, cp_size = %d)" % (o.cp_rank, o.cp_size))
        if max(o.pad_multiple, 1) % (2 * o.cp_size):
            raise Refused("pad_multiple %d is not a multiple of 2 * cp_size = %d"
                          % (o.pad_multiple, 2 * o.cp_size))
    elif o.cp_rank:
        raise Refused("cp_rank %d needs cp_size > 1" % o.cp_rank)
    if o.sp_size > 1:
        if not 0 <= o.sp_rank < o.sp_size:
            raise Refused("sp_rank %d is not in [0, sp_size = %d)" % (o.sp_rank, o.sp_size))
        if o.cp_size > 1:
            raise Refused("sp_size %d and cp_size %d are both set" % (o.sp_size, o.cp_size))
        if o.fixed[0] % o.sp_size:
            raise Refused("fixed.tokens %d is not a multiple of sp_size %d"
                          % (o.fixed[0], o.sp_size))
    elif o.sp_rank:
        raise Refused("sp_rank %d needs sp_size > 1" % o.sp_rank)
    if o.pad_values is not None and len(o.pad_values) not in (0, inputs):
        raise Refused("pad_values has %d values but there are %d inputs"
                      % (len(o.pad_values), inputs))
    for j, (source, _) in enumerate(o.shifts):
        if not 0 <= source < inputs:
            raise Refused("shifts[%d].input %d names no input" % (j, source))


@dataclasses.dataclass
class Seq:
    row: int
    positions: List[int]  # dense s of its tokens, in order


def sequences(mask: List[List[bool]], ids: Optional[List[List[int]]]) -> List[Seq]:
    """§8 and §10: the rows (every one, empty ones included), or with segment ids the
    documents: each row's active tokens cut where the id changes from one active token to the
    next; only non-empty documents."""
    out = []
    for b, row in enumerate(mask):
        active = [s for s, on in enumerate(row) if on]
        if ids is None:
            out.append(Seq(b, active))
            continue
        for i, s in enumerate(active):
            if i == 0 or ids[b][s] != ids[b][active[i - 1]]:
                out.append(Seq(b, []))
            out[-1].positions.append(s)
    return out


@dataclasses.dataclass
class Laid:
    """One rank's rows (each a dense flat position b * S + s, None for padding), their shifted
    rows, position ids and seq_idx; the global prefix arrays and maxima."""
    rows: List[Optional[int]]
    shifted: List[Optional[int]]
    position_ids: List[int]
    seq_idx: List[int]
    cu_real: List[int]
    cu_padded: List[int]
    max_real: int
    max_padded: int


def layout(mask, ids, o: Options, inputs: int = 1) -> Laid:
    validate(o, inputs)
    S = len(mask[0]) if mask else 0
    m = max(o.pad_multiple, 1)
    spans = []  # (real flat positions, padded length)
    for seq in sequences(mask, ids):
        flat = [seq.row * S + s for s in seq.positions]
        spans.append((flat, -(-len(flat) // m) * m))
    n = sum(P for _, P in spans)
    tokens, N, M = o.fixed
    if tokens:
        if tokens < n:
            raise Refused("fixed.tokens %d is less than the %d" % (tokens, n))
        if (tokens - n) % m:
            raise Refused("fixed.tokens %d leaves %d rows" % (tokens, tokens - n))
    u = o.sp_size if o.sp_size > 1 else 1
    ghost = tokens - n if tokens else -n % u
    if ghost:
        spans.append(([], ghost))
    if N and N < len(spans):
        raise Refused("fixed.sequences %d is less than the %d sequences" % (N, len(spans)))
    longest_padded = max([P for _, P in spans], default=0)
    if M and M < longest_padded:
        raise Refused("fixed.max_seqlen %d is less than %d" % (M, longest_padded))
    cu_real, cu_padded = [0], [0]
    for flat, P in spans:
        cu_real.append(cu_real[-1] + len(flat))
        cu_padded.append(cu_padded[-1] + P)
    if N:
        cu_real += [cu_real[-1]] * (N + 1 - len(cu_real))
        cu_padded += [cu_padded[-1]] * (N + 1 - len(cu_padded))
    c = o.cp_size if o.cp_size > 1 else 1
    rows, shifted, positions, seq_idx = [], [], [], []
    for k, (flat, P) in enumerate(spans):
        padded = flat + [None] * (P - len(flat))
        next_tokens = flat[1:] + [None] * (P - len(flat) + 1)
        take = list(range(P))
        if c > 1:  # the dual chunks r and 2c - 1 - r of 2c
            h = P // (2 * c)
            r = o.cp_rank
            take = (list(range(r * h, (r + 1) * h))
                    + list(range((2 * c - 1 - r) * h, (2 * c - r) * h)))
        rows += [padded[i] for i in take]
        shifted += [next_tokens[i] for i in take]
        positions += take
        seq_idx += [k] * len(take)
    if u > 1:  # the contiguous 1 / u
        share = len(rows) // u
        window = slice(o.sp_rank * share, (o.sp_rank + 1) * share)
        rows, shifted = rows[window], shifted[window]
        positions, seq_idx = positions[window], seq_idx[window]
    return Laid(rows, shifted, positions, seq_idx, cu_real, cu_padded,
                M or max([len(f) for f, _ in spans], default=0), M or longest_padded)


def gather(x_rows: Sequence[bytes], at: Sequence[Optional[int]], pad: bytes) -> bytes:
    """The bytes of the rows of x at dense positions `at`, `pad` where there is None."""
    return b"".join(pad if p is None else x_rows[p] for p in at)


def scatter(packed_rows: Sequence[bytes], at: Sequence[Optional[int]], positions: int,
            width: int) -> bytes:
    """Scatter's dense result: zeros, and packed row j at dense position at[j]."""
    dense = [bytes(width)] * positions
    for j, p in enumerate(at):
        if p is not None:
            dense[p] = packed_rows[j]
    return b"".join(dense)


def plan_lengths(mask, ids, o: Options) -> List[int]:
    """§12: each row's length for the plan, its layout rows on one GPU: its sequences' padded
    lengths summed, divided by cp_size, or by sp_size rounded up."""
    m = max(o.pad_multiple, 1)
    lengths = [0] * len(mask)
    for seq in sequences(mask, ids):
        lengths[seq.row] += -(-len(seq.positions) // m) * m
    if o.cp_size > 1:
        return [L // o.cp_size for L in lengths]
    if o.sp_size > 1:
        return [math.ceil(L / o.sp_size) for L in lengths]
    return lengths


def loss_tokens(mask, loss_mask) -> List[int]:
    """§12: a row's loss tokens, active in both masks: the whole row's, on every rank."""
    return [sum(1 for a, b in zip(r, q) if a and b) for r, q in zip(mask, loss_mask)]


def row_metadata(mask):
    """§1: cu_seqlens (per row) and last_index (the dense s of each row's last active token,
    -1 for an empty row)."""
    cu, last = [0], []
    for row in mask:
        active = [s for s, on in enumerate(row) if on]
        cu.append(cu[-1] + len(active))
        last.append(active[-1] if active else -1)
    return cu, last


def documents(mask, ids):
    """§8: each document's row and the dense s of its last token."""
    docs = sequences(mask, ids)
    return [d.row for d in docs], [d.positions[-1] for d in docs]
