"""What the Python test suites compare packd against: random tensors of every dtype (random
bytes, so NaN payloads and -0.0 occur), torch's own scatter as the reference, and byte-exact
comparison.

    x = random_tensor(torch.bfloat16, (4, 16, 8))
    assert same(reference_scatter(x[mask != 0], mask, x), dense)
    rows, shifted, *_ = reference_layout(mask, ids, m=8, cp=2, rank=1)
    assert same(gathered(x, rows, pad=0), r.packed)
"""
import torch

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def random_tensor(dtype, shape, gen=None):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).reshape(shape)


def raw(t):
    """A tensor's bytes, for exact comparison (NaN payloads and -0.0 included)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def bits(t):
    """An integer view of a tensor's bits: torch's index_put_ with a single value converts it
    through a scalar (NaN payloads and signs are lost); on integers indexing only moves bits."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def reference_scatter(packed, mask, like):
    """dense with like's shape and dtype: zeros, and packed's rows at mask's active positions."""
    dense = torch.zeros_like(bits(like))
    dense[mask != 0] = bits(packed)
    return dense.view(like.dtype)


def same(a, b):
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def sequences(mask, ids):
    """Each sequence's dense positions (flattened b * S + s): rows, or documents."""
    B, S = mask.shape
    out = []
    for b in range(B):
        pos = torch.nonzero(mask[b] != 0).flatten().tolist()
        if ids is None:
            out.append([b * S + p for p in pos])
            continue
        for i, p in enumerate(pos):
            if i == 0 or ids[b, p] != ids[b, pos[i - 1]]:
                out.append([])
            out[-1].append(b * S + p)
    return out


def reference_layout(mask, ids, m=1, cp=1, rank=0, tokens=0, sp=1, sp_rank=0):
    """(rows, shifted rows, position ids, seq_idx, cu_padded) of a layout (docs/design.md §10),
    written from its rules: each output row's dense position (b * S + s), -1 for padding. CP
    (cp, rank) or Ulysses (sp, sp_rank)."""
    seqs = sequences(mask, ids)
    m = max(m, 1)
    spans, cu = [], [0]
    for seq in seqs:
        P = -(-len(seq) // m) * m
        spans.append((seq + [-1] * (P - len(seq)), seq[1:] + [-1] * (P - len(seq) + 1)))
        cu.append(cu[-1] + P)
    ghost = tokens - cu[-1] if tokens > cu[-1] else -cu[-1] % sp
    if ghost:
        spans.append(([-1] * ghost, [-1] * ghost))
        cu.append(cu[-1] + ghost)
    rows, shifted, pos, seq_idx = [], [], [], []
    for k, (r, sh) in enumerate(spans):
        P = len(r)
        h = P // (2 * cp)
        take = (list(range(P)) if cp == 1 else
                list(range(rank * h, (rank + 1) * h))
                + list(range((2 * cp - 1 - rank) * h, (2 * cp - rank) * h)))
        rows += [r[i] for i in take]
        shifted += [sh[i] for i in take]
        pos += take
        seq_idx += [k] * len(take)
    n = len(rows) // sp
    window = slice(sp_rank * n, (sp_rank + 1) * n)
    return rows[window], shifted[window], pos[window], seq_idx[window], cu


def gathered(x, rows, pad):
    """x's rows at dense positions `rows`, `pad` (in x's dtype, as torch converts) at -1."""
    B, S = x.shape[:2]
    flat = bits(x).reshape(B * S, *x.shape[2:])
    index = torch.tensor(rows, dtype=torch.int64)
    out = flat[index.clamp(min=0)] if flat.shape[0] else flat.new_empty((len(rows),) + flat.shape[1:])
    pad_bits = bits(torch.tensor([pad], dtype=torch.float64).to(x.dtype))[0]
    out[index < 0] = pad_bits
    return out.view(x.dtype)


def reference_shared(mask, groups, prefix):
    """A shared prefix's stream (docs/design.md §14) as dense flat positions: groups in the
    order of their first rows, each prompt from its first row, then each member's response;
    and each row's targets (its active positions from max(P, 1) on)."""
    S = mask.shape[1]
    active = [torch.nonzero(row).flatten().tolist() for row in mask]
    rows, members = [], {}
    for b, g in enumerate(groups):
        members.setdefault(g, []).append(b)
    for bs in members.values():
        rows += [bs[0] * S + s for s in active[bs[0]][:prefix[bs[0]]]]
        for b in bs:
            rows += [b * S + s for s in active[b][prefix[b]:]]
    targets = [[b * S + s for s in active[b][max(prefix[b], 1):]] for b in range(len(groups))]
    return rows, targets
