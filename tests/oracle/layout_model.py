"""A plain-Python model of packd's layouts (docs/design.md §10), of a training step's plan
(§12) and of shared prompts' streams (§14), written from the rules alone: no torch, no packd. Tensors are lists of rows, a row the
bytes of one [B, S] position; a mask is a list of lists of truth values.

    o = Options(pad_multiple=4, sp_size=2, sp_rank=1, shifts=((0, -100),))
    laid = layout(mask, segment_ids, o)     # or raises Refused("the message packd gives")
    rows = gather(x_rows, laid.rows, pad)   # the bytes packd's packed[i] must hold
    st = shared_stream(mask, Options(shared=(groups, prefix_lengths, (), False)))
    st.rows, st.targets, st.kv_index, st.pred_index  # the stream and its targets
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
    with_token_mask: bool = False  # per-row metadata, not a layout: any() leaves it out
    shifts: Tuple[Tuple[int, float], ...] = ()
    fixed: Tuple[int, int, int] = (0, 0, 0)  # tokens, sequences, max_seqlen
    # §14: (groups, prefix_lengths, same_inputs, targets), or None.
    shared: Optional[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], bool]] = None

    def any(self):
        return bool(self.pad_multiple or self.pad_values or self.cp_size or self.cp_rank
                    or self.sp_size or self.sp_rank or self.with_seq_idx or self.shifts
                    or any(self.fixed) or self.shared is not None)

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


def mrope_positions(mask, ids, tokens, image: int, video: int,
                    grids: Sequence[Tuple[int, int, int]], merge: int) -> dict:
    """§17: {dense flat position: (temporal, height, width)} of every active token, from the
    token ids `tokens` ([B][S]). Each sequence starts at 0; a text token takes the next position
    in all three; a run of image (video) tokens is the next grid, t x h/merge x w/merge tokens
    from the next position p: (p + i, p + y, p + x); the text after it goes on from
    p + max(h, w) // merge."""
    S = len(mask[0]) if mask else 0
    out, g = {}, 0
    for seq in sequences(mask, ids):
        flat = [seq.row * S + s for s in seq.positions]
        kinds = [tokens[seq.row][s] for s in seq.positions]
        p = i = 0
        while i < len(flat):
            if kinds[i] not in (image, video):
                out[flat[i]] = (p, p, p)
                p, i = p + 1, i + 1
                continue
            j = i
            while j < len(flat) and kinds[j] == kinds[i]:
                j += 1
            if g >= len(grids):
                raise Refused("mrope.grids has %d grids" % len(grids))
            t, h, w = grids[g]
            cells = [(a, y, x) for a in range(t) for y in range(h // merge)
                     for x in range(w // merge)]
            if len(cells) != j - i:
                raise Refused("mrope.grids[%d]" % g)
            for k, (a, y, x) in zip(range(i, j), cells):
                out[flat[k]] = (p + a, p + y, p + x)
            p, g, i = p + max(h, w) // merge, g + 1, j
    if g != len(grids):
        raise Refused("mrope.grids has %d grids; the batch's rows have %d runs" % (len(grids), g))
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


# -- §14: shared prompts ----------------------------------------------------------------------


def validate_shared(o: Options, rows: int, inputs: int, documents: bool, pack: bool) -> None:
    """The rules of a shared prefix that hold before the mask is read, after validate()."""
    if o.shared is None:
        return
    groups, prefix, same, targets = o.shared
    for what, bad in (("segment_ids", documents), ("pad_multiple", o.pad_multiple > 1),
                      ("cp_size", o.cp_size > 1), ("sp_size", o.sp_size > 1),
                      ("fixed", any(o.fixed))):
        if bad:
            raise Refused("shared_prefix with %s" % what)
    if pack and targets:
        raise Refused("shared_prefix.targets is Scatter's")
    for name, values in (("groups", groups), ("prefix_lengths", prefix)):
        if len(values) != rows:
            raise Refused("shared_prefix.%s has %d entries but the batch has %d rows"
                          % (name, len(values), rows))
    first = {}
    for b, (g, p) in enumerate(zip(groups, prefix)):
        if p < 0:
            raise Refused("shared_prefix.prefix_lengths[%d] is %d, below 0" % (b, p))
        f = first.setdefault(g, b)
        if prefix[f] != p:
            raise Refused("shared_prefix.prefix_lengths[%d] is %d but row %d" % (b, p, f))
    for j, i in enumerate(same):
        if not 0 <= i < inputs:
            raise Refused("shared_prefix.same_inputs[%d] is %d, which names no input" % (j, i))


@dataclasses.dataclass
class Stream:
    """A shared prefix's stream (§14): each stream row's and each target's dense flat position,
    position ids, seq_idx (the group's index), and the attention metadata."""
    rows: List[int]
    targets: List[int]
    position_ids: List[int]
    seq_idx: List[int]
    cu_q: List[int]
    cu_k: List[int]
    kv_index: List[int]
    max_q: int
    max_k: int
    pred_index: List[int]
    target_cu: List[int]
    segment_row: List[int]
    row_lengths: List[int]  # a step's plan lengths: the stream rows each row brings


def shared_stream(mask, o: Options) -> Stream:
    groups, prefix, _, _ = o.shared
    S = len(mask[0]) if mask else 0
    active = [[s for s, on in enumerate(row) if on] for row in mask]
    order, members = [], {}
    for b, g in enumerate(groups):
        if g not in members:
            order.append(b)
            members[g] = []
        members[g].append(b)
    for f in order:
        for m in members[groups[f]]:
            if len(active[m]) < prefix[f]:
                raise Refused("shared_prefix.prefix_lengths[%d] is %d but row %d has %d active "
                              "tokens" % (m, prefix[f], m, len(active[m])))
    st = Stream([], [], [], [], [0], [0], [], 0, 0, [], [0], [], [0] * len(mask))
    prompt_of, response_of = {}, {}

    def segment(row, queries, keys):
        st.kv_index.extend(keys)
        st.cu_q.append(st.cu_q[-1] + len(queries))
        st.cu_k.append(st.cu_k[-1] + len(keys))
        st.max_q, st.max_k = max(st.max_q, len(queries)), max(st.max_k, len(keys))
        st.segment_row.append(row)
        st.row_lengths[row] += len(queries)

    for g, f in enumerate(order):
        P = prefix[f]
        prompt = list(range(len(st.rows), len(st.rows) + P))
        st.rows += [f * S + s for s in active[f][:P]]
        st.position_ids += list(range(P))
        st.seq_idx += [g] * P
        if P:
            segment(f, prompt, prompt)
        for m in members[groups[f]]:
            response = list(range(len(st.rows), len(st.rows) + len(active[m]) - P))
            prompt_of[m], response_of[m] = prompt, response
            st.rows += [m * S + s for s in active[m][P:]]
            st.position_ids += list(range(P, len(active[m])))
            st.seq_idx += [g] * len(response)
            if response:
                segment(m, response, prompt + response)
    for b, row in enumerate(active):
        P = prefix[b]
        for j in range(max(P, 1), len(row)):
            st.targets.append(b * S + row[j])
            st.pred_index.append(prompt_of[b][j - 1] if j - 1 < P else response_of[b][j - 1 - P])
        st.target_cu.append(len(st.targets))
    return st


def shared_loss_tokens(mask, loss_mask, prefix) -> List[int]:
    """§14, a step: a row's loss tokens are its targets active in loss_mask."""
    out = []
    for row, lrow, P in zip(mask, loss_mask, prefix):
        active = [s for s, on in enumerate(row) if on]
        out.append(sum(1 for s in active[max(P, 1):] if lrow[s]))
    return out


def check_same_prompts(x_rows: Sequence[bytes], mask, o: Options, input_index: int) -> None:
    """INVALID_ARGUMENT when a member's prompt differs from its group's first row's: groups
    in the order of their first rows, members in row order, the first token that differs."""
    groups, prefix, _, _ = o.shared
    S = len(mask[0]) if mask else 0
    active = [[s for s, on in enumerate(row) if on] for row in mask]
    members = {}
    for b, g in enumerate(groups):
        members.setdefault(g, []).append(b)
    for g, rows in members.items():  # dicts keep the order of first rows
        f = rows[0]
        for b in rows[1:]:
            for i in range(prefix[b]):
                if x_rows[b * S + active[b][i]] != x_rows[f * S + active[f][i]]:
                    raise Refused("inputs[%d] differs across group %d: row %d's prompt token %d"
                                  % (input_index, g, b, i))
