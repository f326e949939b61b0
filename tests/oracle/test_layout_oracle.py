"""Every layout in every call, against the plain-Python model (layout_model.py).

The cross product of the layout options (documents, padding, CP or Ulysses SP, fixed shapes,
shifts, seq_idx) for Pack, for Scatter (the options that place rows) and for PackMicroBatches,
on each backend (span, torch, fake GPU), each combination on fresh random data with 1- to
16-byte rows (and a wide one), pad values, position ids and a random rank. A combination the
design refuses (CP without a multiple of 2 * cp_size, CP with SP, ...) is checked for its named
INVALID_ARGUMENT, and the server serves the next call. Each test asserts that every one of its
combinations ran; the summary prints how many did.

PACKD_ORACLE_SEED=N repeats a run (the seed is printed with every failure)."""
import itertools
import os
import random

import pytest
import torch

import packd
from conftest import COVERAGE
from layout_model import (Options, Refused, documents, gather, layout, loss_tokens,
                          plan_lengths, row_metadata, scatter)
from torch_reference import random_tensor, raw

SEED = int(os.environ.get("PACKD_ORACLE_SEED", random.randrange(1 << 31)))

# Row widths in bytes, and the inputs that have them: [B, S, *tail] of dtype.
ROWS = {
    1: [(torch.uint8, ()), (torch.bool, ()), (torch.int8, ())],
    2: [(torch.int16, ()), (torch.float16, ()), (torch.bfloat16, ()), (torch.uint8, (2,))],
    3: [(torch.uint8, (3,))],
    4: [(torch.int32, ()), (torch.float32, ()), (torch.int16, (2,))],
    6: [(torch.int16, (3,))],
    8: [(torch.int64, ()), (torch.float64, ()), (torch.float32, (2,))],
    12: [(torch.float32, (3,))],
    16: [(torch.float64, (2,)), (torch.int32, (2, 2)), (torch.int64, (2,))],
    96: [(torch.float32, (4, 6))],  # a wide row: the dense-gather path
}
REQUIRED_WIDTHS = {1, 2, 4, 8, 16}
# A pad value or fill each dtype holds exactly.
VALUE = {torch.bool: 1, torch.uint8: 7, torch.int8: -3, torch.int16: -100, torch.int32: -100,
         torch.int64: -100, torch.float16: -1.5, torch.bfloat16: -1.5, torch.float32: -1.5,
         torch.float64: -1.5}
ID_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]

LAYOUT_DIMS = {"docs": (False, True), "pad": (False, True), "parallel": ("none", "cp", "sp"),
               "fixed": (False, True), "shifts": (False, True), "seq_idx": (False, True)}
SCATTER_DIMS = ("docs", "pad", "parallel", "fixed")
OPS = {"pack": tuple(LAYOUT_DIMS), "scatter": SCATTER_DIMS, "step": tuple(LAYOUT_DIMS)}
BACKENDS = ("span", "torch", "fake_gpu")

# Combinations the design refuses whatever the batch, with the words packd must say; the
# option sets each op takes (Scatter takes no shifts).
REFUSED = [
    ("cp and sp", dict(cp_size=2, cp_rank=0, sp_size=2, pad_multiple=4),
     "sp_size 2 and cp_size 2 are both set"),
    ("cp rank", dict(cp_size=2, cp_rank=2, pad_multiple=4), "cp_rank 2 is not in [0, cp_size = 2)"),
    ("sp rank", dict(sp_size=3, sp_rank=3), "sp_rank 3 is not in [0, sp_size = 3)"),
    ("sp rank alone", dict(sp_rank=1), "sp_rank 1 needs sp_size > 1"),
    ("sp fixed tokens", dict(sp_size=4, fixed=(6, 0, 0)),
     "fixed.tokens 6 is not a multiple of sp_size 4"),
    ("negative sp", dict(sp_size=-1), "sp_size -1 is negative"),
]


def cells(op):
    dims = OPS[op]
    for values in itertools.product(*(LAYOUT_DIMS[d] for d in dims)):
        yield dict(zip(dims, values))


def key_of(cell):
    return " ".join("%s=%s" % kv for kv in sorted(cell.items()))


def rows_of(x):
    """x [B, S, *tail] as B * S rows of bytes."""
    data = raw(x)
    n = x.shape[0] * x.shape[1]
    w = len(data) // n if n else 0
    return [data[i * w:(i + 1) * w] for i in range(n)], w


def value_bytes(dtype, tail, value):
    """`value` in dtype, as torch converts it, repeated over the tail."""
    one = raw(torch.tensor([float(value)], dtype=torch.float64).to(dtype))
    return one * max(1, int(torch.Size(tail).numel()))


class Case:
    """One random batch for a combination: mask, ids, inputs and the layout options."""

    def __init__(self, rng, gen, cell, width, op):
        self.B, self.S = rng.randint(1, 6), rng.randint(1, 24)
        kind = rng.choice(["random", "prefix", "full", "sparse"])
        if kind == "full":
            mask = torch.ones(self.B, self.S, dtype=torch.bool)
        elif kind == "prefix":
            lengths = torch.randint(0, self.S + 1, (self.B,), generator=gen)
            mask = torch.arange(self.S)[None, :] < lengths[:, None]
        else:
            mask = torch.rand(self.B, self.S, generator=gen) < (0.6 if kind == "random" else 0.15)
        self.mask = mask.to(rng.choice([torch.bool, torch.uint8, torch.float32]))
        self.mask_lists = (self.mask != 0).tolist()
        self.ids = None
        if cell["docs"]:
            self.ids = torch.randint(0, 3, (self.B, self.S), generator=gen).to(
                rng.choice(ID_DTYPES))
        self.ids_lists = None if self.ids is None else self.ids.tolist()
        specs = [rng.choice(ROWS[width])] + [rng.choice(ROWS[rng.choice(list(ROWS))])
                                             for _ in range(rng.randint(0, 2))]
        self.inputs = [random_tensor(dtype, (self.B, self.S) + tail, gen) for dtype, tail in specs]
        self.with_position_ids = rng.random() < 0.7
        self.options = self._options(rng, cell, op)

    def _options(self, rng, cell, op):
        o = {}
        if cell["pad"]:
            o["pad_multiple"] = rng.randint(2, 6)
        elif rng.random() < 0.3:
            o["pad_multiple"] = 1  # set, and changes nothing
        if cell["parallel"] == "cp":
            c = rng.choice([2, 3])
            o.update(cp_size=c, cp_rank=rng.randrange(c))
            if cell["pad"]:
                o["pad_multiple"] = 2 * c * rng.randint(1, 2)
        elif cell["parallel"] == "sp":
            u = rng.choice([2, 3, 4])
            o.update(sp_size=u, sp_rank=rng.randrange(u))
        if op != "scatter":
            if rng.random() < 0.5:
                o["pad_values"] = [VALUE[x.dtype] for x in self.inputs]
            if cell["shifts"]:
                o["shifts"] = [(j, VALUE[self.inputs[j].dtype]) for j in
                               rng.sample(range(len(self.inputs)), rng.randint(1, len(self.inputs)))]
            o["with_seq_idx"] = cell["seq_idx"]
        if cell["fixed"]:
            o["fixed"] = self._fixed(rng, o, whole_batch=op == "step")
        return o

    def _fixed(self, rng, o, whole_batch):
        """(tokens, sequences, max_seqlen) that hold the batch (a step: every micro-batch of
        it), each randomly left 0, with a ghost or not."""
        base = Options(pad_multiple=o.get("pad_multiple", 0))
        try:
            laid = layout(self.mask_lists, self.ids_lists, base)
        except Refused:
            return (0, 0, 0)
        m = max(o.get("pad_multiple", 0), 1)
        u = o.get("sp_size", 0) if o.get("sp_size", 0) > 1 else 1
        n = laid.cu_padded[-1]
        extra = rng.randint(0, 2) if not whole_batch else rng.randint(0, 1)
        tokens = n + m * extra
        while tokens % u:
            tokens += m
        if whole_batch:
            tokens += m * u  # room for a ghost in every micro-batch
        sequences = len(laid.cu_real) + 1 + rng.randint(0, 2)
        fields = [tokens, sequences, tokens]
        keep = rng.choice([(1, 1, 1), (1, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 0)])
        return tuple(v if k else 0 for v, k in zip(fields, keep))

    def model_options(self, op):
        o = dict(self.options)
        if "pad_values" in o:
            o["pad_values"] = tuple(o["pad_values"])
        if "shifts" in o:
            o["shifts"] = tuple(tuple(s) for s in o["shifts"])
        if "fixed" in o:
            o["fixed"] = tuple(o["fixed"])
        return Options(**o)


def expect_pack(r, case, mask, ids, inputs, o, what):
    """r (a PackResult) is the model's Pack of inputs under mask (lists) with options o."""
    laid = layout(mask, ids, o, len(inputs))
    rows = [rows_of(x)[0] for x in inputs]
    for i, x in enumerate(inputs):
        pad = value_bytes(x.dtype, x.shape[2:], o.pad_values[i] if o.pad_values else 0)
        assert raw(r.packed[i]) == gather(rows[i], laid.rows, pad), "%s: packed[%d]" % (what, i)
        assert r.packed[i].dtype == x.dtype and list(r.packed[i].shape) == (
            [len(laid.rows)] + list(x.shape[2:])), what
    for j, (source, fill) in enumerate(o.shifts):
        x = inputs[source]
        want = gather(rows[source], laid.shifted, value_bytes(x.dtype, x.shape[2:], fill))
        assert raw(r.shifted[j]) == want, "%s: shifted[%d]" % (what, j)
    if not o.shifts:
        assert r.shifted is None, what
    if case.with_position_ids:
        assert r.position_ids.tolist() == laid.position_ids, "%s: position_ids" % what
    if o.with_seq_idx:
        assert r.seq_idx.tolist() == laid.seq_idx, "%s: seq_idx" % what
    cu_rows, last = row_metadata(mask)
    assert r.last_index.tolist() == last and r.total_active == cu_rows[-1], what
    if ids is not None:
        assert r.cu_seqlens.tolist() == cu_rows, "%s: cu_seqlens" % what
        assert r.doc_cu_seqlens.tolist() == laid.cu_real, "%s: doc_cu_seqlens" % what
        assert r.doc_max_seqlen == laid.max_real, "%s: doc_max_seqlen" % what
        doc_row, doc_last = documents(mask, ids)
        assert r.doc_row.tolist() == doc_row and r.doc_last_index.tolist() == doc_last, what
    else:
        assert r.cu_seqlens.tolist() == laid.cu_real, "%s: cu_seqlens" % what
        assert r.max_seqlen == laid.max_real, "%s: max_seqlen" % what
    if o.reshapes():
        assert r.cu_seqlens_padded.tolist() == laid.cu_padded, "%s: cu_seqlens_padded" % what
        assert r.max_seqlen_padded == laid.max_padded, "%s: max_seqlen_padded" % what
    else:
        assert r.cu_seqlens_padded is None and r.max_seqlen_padded == 0, what


def run_pack(client, device, case, o, what):
    r = client.pack(case.inputs, case.mask, segment_ids=case.ids, device=device,
                    with_position_ids=case.with_position_ids, **case.options)
    expect_pack(r, case, case.mask_lists, case.ids_lists, case.inputs, o, what)


def run_scatter(client, device, case, o, what, gen):
    try:
        laid = layout(case.mask_lists, case.ids_lists, o)
    except Refused:  # what packd must refuse, sent with the plain Pack's rows
        laid = layout(case.mask_lists, case.ids_lists, Options())
    for x in case.inputs:
        packed = random_tensor(x.dtype, (len(laid.rows),) + tuple(x.shape[2:]), gen)
        dense = client.scatter(packed, case.mask, segment_ids=case.ids, device=device,
                               **case.options)
        rows = rows_of(packed.unsqueeze(0))[0]
        width = len(value_bytes(x.dtype, x.shape[2:], 0))
        assert raw(dense) == scatter(rows, laid.rows, case.B * case.S, width), what
        assert dense.dtype == x.dtype and tuple(dense.shape) == tuple(x.shape), what


def run_step(client, device, case, o, what, rng):
    loss_mask = torch.rand(case.B, case.S) < 0.7
    lengths = plan_lengths(case.mask_lists, case.ids_lists, o)
    losses = loss_tokens(case.mask_lists, loss_mask.tolist())
    budget = max(max(lengths) + rng.randint(0, sum(lengths)), 1)
    ranks = rng.randint(1, 3)
    step = client.pack_micro_batches(
        case.inputs, case.mask, budget, num_ranks=ranks, loss_mask=loss_mask,
        segment_ids=case.ids, device=device, with_position_ids=case.with_position_ids,
        **case.options)
    plan = step.plan
    assert plan.global_loss_tokens == sum(losses), what
    seen = sorted(s for mb in plan.micro_batches for s in mb.samples)
    assert seen == list(range(case.B)), what
    assert len(plan.micro_batches) == ranks * plan.micro_batches_per_rank, what
    for mb in plan.micro_batches:
        assert mb.tokens == sum(lengths[s] for s in mb.samples), "%s: plan lengths" % what
        assert mb.loss_tokens == sum(losses[s] for s in mb.samples), what
        assert mb.padded_tokens <= budget or len(mb.samples) == 1, what
    count = 0
    for mb in step:
        rows = mb.samples
        assert rows == plan.micro_batches[mb.rank * plan.micro_batches_per_rank
                                          + mb.index].samples, what
        sub = [x[rows] for x in case.inputs]
        ids = None if case.ids is None else [case.ids_lists[b] for b in rows]
        expect_pack(mb.result, case, [case.mask_lists[b] for b in rows], ids, sub, o,
                    "%s: micro-batch %d of rank %d" % (what, mb.index, mb.rank))
        count += 1
    assert count == len(plan.micro_batches), what


def run(client, device, op, case, o, what, rng, gen):
    if op == "pack":
        run_pack(client, device, case, o, what)
    elif op == "scatter":
        run_scatter(client, device, case, o, what, gen)
    else:
        run_step(client, device, case, o, what, rng)


def expect_refused(client, device, op, case, o, what, rng, gen, message):
    """packd refuses the call with INVALID_ARGUMENT saying `message`."""
    with pytest.raises(packd.PackdError) as e:
        run(client, device, op, case, o, what, rng, gen)
    assert isinstance(e.value, ValueError), what
    assert message in e.value.details, "%s: %s" % (what, e.value.details)


def seeded(*names):
    """A random.Random and a torch.Generator for one test, from the run's seed."""
    rng = random.Random(" ".join(str(n) for n in (SEED,) + names))
    return rng, torch.Generator().manual_seed(rng.randrange(1 << 62))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_every_layout_combination(servers, op, backend):
    address, device = servers[backend]
    rng, gen = seeded(op, backend)
    coverage = COVERAGE[(op, backend)]
    ran, widths = set(), set()
    width_cycle = sorted(ROWS)
    with packd.Client(address, shm_threshold_bytes=0) as client:
        for n, cell in enumerate(cells(op)):
            width = width_cycle[n % len(width_cycle)]
            case = Case(rng, gen, cell, width, op)
            what = "PACKD_ORACLE_SEED=%d %s on %s, %s, B %d S %d, %s" % (
                SEED, op, backend, key_of(cell), case.B, case.S, case.options)
            o = case.model_options(op)
            try:
                layout(case.mask_lists, case.ids_lists, o, len(case.inputs))
                refused = None
            except Refused as e:
                refused = str(e)
            if refused is None:
                run(client, device, op, case, o, what, rng, gen)
                coverage[key_of(cell)] += 1
                ran.add(key_of(cell))
                widths.add(width)
            else:
                # The design refuses it (CP without a multiple of 2 * cp_size): by name.
                expect_refused(client, device, op, case, o, what, rng, gen, refused)
                coverage["refused " + key_of(cell)] += 1
                ran.add(key_of(cell))
        # Every combination ran, and every row width.
        assert ran == {key_of(cell) for cell in cells(op)}, sorted(ran)
        assert REQUIRED_WIDTHS <= widths, widths
        # The server serves on after every refusal.
        x = torch.arange(6).view(1, 6)
        assert client.pack(x, torch.ones(1, 6), device=device).packed.tolist() == list(range(6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_refused_combinations_name_their_field(servers, op, backend):
    address, device = servers[backend]
    rng, gen = seeded("refused", op, backend)
    coverage = COVERAGE[(op, backend)]
    plain = dict(docs=False, pad=False, parallel="none", fixed=False, shifts=False,
                 seq_idx=False)
    with packd.Client(address, shm_threshold_bytes=0) as client:
        for name, options, message in REFUSED:
            case = Case(rng, gen, plain, 8, op)
            case.options = dict(options)
            o = case.model_options(op)
            with pytest.raises(Refused, match=None) as model:
                layout(case.mask_lists, case.ids_lists, o, len(case.inputs))
            assert message in str(model.value), name
            expect_refused(client, device, op, case, o, name, rng, gen, message)
            coverage["refused " + name] += 1
