"""Every layout in every call, against the plain-Python model (layout_model.py).

The cross product of the layout options (documents, padding, CP or Ulysses SP, fixed shapes,
shifts, seq_idx with the token mask and, for Pack, multimodal positions of image and video runs,
a shared prefix) for Pack, for Scatter (the options that place rows, and a shared prefix's
stream or targets), for PackMicroBatches and for the streaming step (its groups submitted in a
random order, every rank and CP or SP rank receiving),
on each backend (span, torch, fake GPU; and every tensor in fake GPU memory), each combination on fresh random data with 1- to
16-byte rows (and a wide one), pad values, position ids and a random rank. A combination the
design refuses (CP without a multiple of 2 * cp_size, CP with SP, ...) is checked for its named
INVALID_ARGUMENT, and the server serves the next call. Each test asserts that every one of its
combinations ran; the summary prints how many did. Shared prompts (§14) also run many random
groupings of their own, and each of their errors.

PACKD_ORACLE_SEED=N repeats a run (the seed is printed with every failure)."""
import contextlib
import dataclasses
import itertools
import os
import random
import re
import threading

import pytest
import torch

import packd
from conftest import COVERAGE
from layout_model import (Options, Refused, check_same_prompts, documents, gather, layout,
                          loss_tokens, mrope_positions, plan_lengths, row_metadata, scatter,
                          sequences, shared_loss_tokens, shared_stream, validate,
                          validate_shared)
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
               "fixed": (False, True), "shifts": (False, True), "seq_idx": (False, True),
               "shared": (False, True)}
SCATTER_DIMS = {d: LAYOUT_DIMS[d] for d in ("docs", "pad", "parallel", "fixed")}
SCATTER_DIMS["shared"] = ("none", "stream", "targets")
OPS = {"pack": LAYOUT_DIMS, "scatter": SCATTER_DIMS, "step": LAYOUT_DIMS, "stream": LAYOUT_DIMS}
PLAIN = dict(docs=False, pad=False, parallel="none", fixed=False, shifts=False, seq_idx=False,
             shared=False)
BACKENDS = ("span", "torch", "fake_gpu", "gpu_memory")

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
    for values in itertools.product(*dims.values()):
        yield dict(zip(dims, values))


def is_shared(cell):
    return cell["shared"] not in (False, "none")


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

    def __init__(self, rng, gen, cell, width, op, kind=None, rows=None):
        self.B, self.S = rows or rng.randint(1, 6), rng.randint(1, 24)
        kind = kind or rng.choice(["random", "prefix", "full", "sparse"])
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
        self.mrope = None
        if op == "pack" and cell["seq_idx"] and not is_shared(cell):
            self._vision_tokens(rng, gen)
        self.options = self._options(rng, cell, op)
        if self.mrope is not None:
            self.options["mrope"] = self.mrope

    def _vision_tokens(self, rng, gen):
        """§17 with the per-row arrays: one more input, token ids holding runs of image and
        video tokens (9, 10) inside the sequences, and the MRope of their grids (merge 2)."""
        tokens = torch.randint(11, 100, (self.B, self.S), generator=gen)
        grids = []
        for seq in sequences(self.mask_lists, self.ids_lists):
            room = len(seq.positions)
            if room < 2 or rng.random() < 0.3:
                continue
            t = 2 if room > 2 and rng.random() < 0.3 else 1
            lh, lw = 1, rng.randint(1, max(1, (room - 1) // t))
            start = rng.randrange(0, room - t * lh * lw + 1)
            for s in seq.positions[start:start + t * lh * lw]:
                tokens[seq.row, s] = 10 if t > 1 else 9
            grids.append((t, 2 * lh, 2 * lw))
        self.inputs.append(tokens)
        self.mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=grids,
                                 input=len(self.inputs) - 1)

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
            o["with_token_mask"] = cell["seq_idx"]  # the other per-row array rides with it
        if cell["fixed"]:
            o["fixed"] = self._fixed(rng, o, whole_batch=op in ("step", "stream"))
        if is_shared(cell):
            o["shared_prefix"] = self._share(rng, op, targets=cell["shared"] == "targets")
        return o

    def _share(self, rng, op, targets):
        """GRPO groups: random ids in any order (groups of one among them), each group's
        prompt no longer than its shortest member (often 0 or all of it), and the inputs of
        same_inputs made equal over every member's prompt (the others differ: packd takes the
        prompt from the group's first row)."""
        ids = rng.sample(range(-3, 40), rng.randint(1, self.B))
        groups = [rng.choice(ids) for _ in range(self.B)]
        active = [[s for s, on in enumerate(row) if on] for row in self.mask_lists]
        prefix_of = {}
        for g in groups:
            shortest = min(len(active[b]) for b in range(self.B) if groups[b] == g)
            prefix_of[g] = rng.choice([0, shortest, rng.randint(0, shortest)])
        prefix = [prefix_of[g] for g in groups]
        inputs = 1 if op == "scatter" else len(self.inputs)  # Scatter sends one at a time
        same = rng.sample(range(inputs), rng.randint(0, inputs))
        for i in same if op != "scatter" else ():
            x = self.inputs[i]
            for b, g in enumerate(groups):
                f = groups.index(g)
                for j in range(prefix[b]):
                    x[b, active[b][j]] = x[f, active[f][j]]
        return packd.SharedPrefix(groups, prefix, same, targets)

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
        o.pop("mrope", None)  # per-row metadata: expect_row_metadata checks it
        if "pad_values" in o:
            o["pad_values"] = tuple(o["pad_values"])
        if "shifts" in o:
            o["shifts"] = tuple(tuple(s) for s in o["shifts"])
        if "fixed" in o:
            o["fixed"] = tuple(o["fixed"])
        if "shared_prefix" in o:
            sp = o.pop("shared_prefix")
            o["shared"] = (tuple(sp.groups), tuple(sp.prefix_lengths), tuple(sp.same_inputs),
                           sp.targets)
        return Options(**o)


def model_call(op, mask, ids, inputs, o):
    """The model's layout of a call (a Laid, or a shared prefix's Stream), or Refused with what
    packd must say, its checks in packd's order: the options, the shared prefix's rules, the
    prompts against the mask, then same_inputs."""
    n = len(inputs)
    if o.shared is None:
        return layout(mask, ids, o, n)
    validate(o, n)
    validate_shared(o, len(mask), n, ids is not None, pack=op != "scatter")
    stream = shared_stream(mask, o)
    if op != "scatter":
        for i in o.shared[2]:
            check_same_prompts(rows_of(inputs[i])[0], mask, o, i)
    return stream


def case_call(op, case, o):
    # Scatter sends its tensors one at a time.
    inputs = case.inputs[:1] if op == "scatter" else case.inputs
    return model_call(op, case.mask_lists, case.ids_lists, inputs, o)


def expect_row_metadata(r, case, mask, o, want, total_active, what):
    """r's shifted (none without shifts), position ids and seq_idx as `want` (a layout or a
    shared stream) has them, and its last_index and total_active."""
    if not o.shifts:
        assert r.shifted is None, what
    if case.with_position_ids:
        assert r.position_ids.tolist() == want.position_ids, "%s: position_ids" % what
    if o.with_seq_idx:
        assert r.seq_idx.tolist() == want.seq_idx, "%s: seq_idx" % what
    if o.with_token_mask:
        assert r.token_mask.tolist() == [int(at is not None) for at in want.rows], (
            "%s: token_mask" % what)
    else:
        assert r.token_mask is None, what
    if getattr(case, "mrope", None) is not None:
        m = case.mrope
        positions = mrope_positions(mask, case.ids_lists, case.inputs[m.input].tolist(),
                                    m.image_token_id, m.video_token_id, m.grids, 2)
        rows = [positions[at] if at is not None else (p, p, p)
                for at, p in zip(want.rows, want.position_ids)]
        want_mrope = [[row[d] for row in rows] for d in range(3)]
        assert r.mrope_position_ids.tolist() == want_mrope, "%s: mrope_position_ids" % what
    _, last = row_metadata(mask)
    assert r.last_index.tolist() == last and r.total_active == total_active, what


def expect_shared_pack(r, case, mask, inputs, o, what):
    """r is the model's Pack with a shared prefix: the stream, targets and metadata (§14)."""
    st = shared_stream(mask, o)
    rows = [rows_of(x)[0] for x in inputs]
    for i, x in enumerate(inputs):
        assert raw(r.packed[i]) == gather(rows[i], st.rows, b""), "%s: packed[%d]" % (what, i)
        assert r.packed[i].dtype == x.dtype and list(r.packed[i].shape) == (
            [len(st.rows)] + list(x.shape[2:])), what
    for j, (source, _) in enumerate(o.shifts):  # in target space: fill is unused
        x = inputs[source]
        assert raw(r.shifted[j]) == gather(rows[source], st.targets, b""), (
            "%s: shifted[%d]" % (what, j))
        assert list(r.shifted[j].shape) == [len(st.targets)] + list(x.shape[2:]), what
    expect_row_metadata(r, case, mask, o, st, len(st.rows), what)
    assert r.cu_seqlens.tolist() == st.cu_q and r.max_seqlen == st.max_q, "%s: cu_seqlens" % what
    assert r.cu_seqlens_padded is None and r.max_seqlen_padded == 0, what
    s = r.shared
    for name, want in (("cu_seqlens_q", st.cu_q), ("cu_seqlens_k", st.cu_k),
                       ("kv_index", st.kv_index), ("pred_index", st.pred_index),
                       ("target_cu_seqlens", st.target_cu), ("segment_row", st.segment_row)):
        assert getattr(s, name).tolist() == want, "%s: shared.%s" % (what, name)
    assert (s.max_seqlen_q, s.max_seqlen_k) == (st.max_q, st.max_k), "%s: shared maxima" % what


def expect_pack(r, case, mask, ids, inputs, o, what):
    """r (a PackResult) is the model's Pack of inputs under mask (lists) with options o."""
    if o.shared is not None:
        return expect_shared_pack(r, case, mask, inputs, o, what)
    assert r.shared is None, what
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
    cu_rows, _ = row_metadata(mask)
    expect_row_metadata(r, case, mask, o, laid, cu_rows[-1], what)
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
                    with_position_ids=case.with_position_ids,
                    layout=packd.Layout(**case.options))
    expect_pack(r, case, case.mask_lists, case.ids_lists, case.inputs, o, what)


def run_scatter(client, device, case, o, what, gen):
    try:
        laid = case_call("scatter", case, o)
        # A shared prefix's Scatter puts the stream's rows back, or with targets its targets.
        at = laid.rows if o.shared is None or not o.shared[3] else laid.targets
    except Refused:  # what packd must refuse, sent with the plain Pack's rows
        at = layout(case.mask_lists, case.ids_lists, Options()).rows
    for x in case.inputs:
        packed = random_tensor(x.dtype, (len(at),) + tuple(x.shape[2:]), gen)
        dense = client.scatter(packed, case.mask, segment_ids=case.ids, device=device,
                               layout=packd.Layout(**case.options))
        rows = rows_of(packed.unsqueeze(0))[0]
        width = len(value_bytes(x.dtype, x.shape[2:], 0))
        assert raw(dense) == scatter(rows, at, case.B * case.S, width), what
        assert dense.dtype == x.dtype and tuple(dense.shape) == tuple(x.shape), what


def run_step(client, device, case, o, what, rng):
    loss_mask = torch.rand(case.B, case.S) < 0.7
    kwargs = dict(plan=packd.PlanOptions(num_ranks=rng.randint(1, 3)), loss_mask=loss_mask,
                  segment_ids=case.ids, device=device, with_position_ids=case.with_position_ids,
                  layout=packd.Layout(**case.options))
    try:
        case_call("step", case, o)
    except Refused:  # what packd must refuse, with any budget
        client.pack_micro_batches(case.inputs, case.mask, 1 << 20, **kwargs)
        return
    if o.shared is None:
        lengths = plan_lengths(case.mask_lists, case.ids_lists, o)
        losses = loss_tokens(case.mask_lists, loss_mask.tolist())
        unit_of = list(range(case.B))
    else:  # a group is one unit: its stream rows, its targets under loss_mask
        groups, prefix, same, _ = o.shared
        lengths = shared_stream(case.mask_lists, o).row_lengths
        losses = shared_loss_tokens(case.mask_lists, loss_mask.tolist(), prefix)
        unit_of = list(groups)
    units = {}
    for b, u in enumerate(unit_of):
        units[u] = units.get(u, 0) + lengths[b]
    budget = max(max(units.values()) + rng.randint(0, sum(lengths)), 1)
    ranks = kwargs["plan"].num_ranks
    step = client.pack_micro_batches(case.inputs, case.mask, budget, **kwargs)
    plan = step.plan
    assert plan.global_loss_tokens == sum(losses), what
    seen = sorted(s for mb in plan.micro_batches for s in mb.samples)
    assert seen == list(range(case.B)), what
    assert len(plan.micro_batches) == ranks * plan.micro_batches_per_rank, what
    for mb in plan.micro_batches:
        assert mb.tokens == sum(lengths[s] for s in mb.samples), "%s: plan lengths" % what
        assert mb.loss_tokens == sum(losses[s] for s in mb.samples), what
        assert mb.padded_tokens <= budget or len({unit_of[s] for s in mb.samples}) == 1, what
    for u in set(unit_of):  # a unit is never split
        assert sum(1 for mb in plan.micro_batches if u in {unit_of[s] for s in mb.samples}) == 1
    count = 0
    for mb in step:
        rows = mb.samples
        assert rows == plan.micro_batches[mb.rank * plan.micro_batches_per_rank
                                          + mb.index].samples, what
        sub = [x[rows] for x in case.inputs]
        ids = None if case.ids is None else [case.ids_lists[b] for b in rows]
        sub_o = o
        if o.shared is not None:  # Pack of its rows with their groups and prompts
            sub_o = dataclasses.replace(o, shared=(tuple(groups[b] for b in rows),
                                                   tuple(prefix[b] for b in rows), same, False))
        expect_pack(mb.result, case, [case.mask_lists[b] for b in rows], ids, sub, sub_o,
                    "%s: micro-batch %d of rank %d" % (what, mb.index, mb.rank))
        count += 1
    assert count == len(plan.micro_batches), what


class Collect(threading.Thread):
    """A streaming step's receiver on a thread: its micro-batches, or its error."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.micro_batches, self.error = stream, [], None
        self.start()

    def run(self):
        try:
            self.micro_batches.extend(self.stream)
        except packd.PackdError as e:
            self.error = e


def stream_groups(case, rng):
    """The batch's rows as the groups a streaming step takes, in a random order: a shared
    prefix's groups whole (their rows in batch order), else random runs of rows."""
    sp = case.options.get("shared_prefix")
    if sp is not None:
        ids = list(sp.groups)[:case.B]
        groups = [[b for b in range(case.B) if ids[b] == g] for g in dict.fromkeys(ids)]
    else:
        cuts = sorted(rng.sample(range(1, case.B), rng.randint(0, case.B - 1)))
        groups = [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [case.B])]
    rng.shuffle(groups)
    return groups


def run_stream(client, device, case, o, what, rng):
    """The streaming step of the case's batch (docs/design.md §18), opened with its layout:
    every rank and CP or SP rank receives, and each micro-batch is the model's Pack of its rows
    for that receiver; every row is in exactly one micro-batch of each receiver's rank."""
    opts = {k: v for k, v in case.options.items() if k not in ("cp_rank", "sp_rank")}
    sp = opts.get("shared_prefix")
    if sp is not None:  # each group brings its rows' prompt lengths
        opts["shared_prefix"] = packd.SharedPrefix((), (), sp.same_inputs, sp.targets)
    receivers = max(o.cp_size, o.sp_size, 1)
    ranks = rng.randint(1, 2)
    budget = 1 << 20
    try:
        case_call("step", case, o)
    except Refused:  # what packd must refuse: the group, with the step's layout
        with client.open_step(budget, layout=packd.Layout(**opts), device=device,
                              with_position_ids=case.with_position_ids) as step:
            client.submit_group(step.step_id, case.inputs, case.mask, segment_ids=case.ids,
                                prefix_lengths=None if sp is None else sp.prefix_lengths)
        return
    if sp is None:
        lengths = plan_lengths(case.mask_lists, case.ids_lists, o)
        budget = max(max(lengths) + rng.randint(0, sum(lengths)), 1)
    with client.open_step(budget, plan=packd.PlanOptions(num_ranks=ranks),
                          layout=packd.Layout(**opts), device=device,
                          with_position_ids=case.with_position_ids,
                          wave_fill=rng.choice([0.0, 0.5])) as step:
        collectors = {(r, c): Collect(client.receive_step(step.step_id, r, cp_rank=c))
                      for r in range(ranks) for c in range(receivers)}
        batch_row = {}
        for rows in stream_groups(case, rng):
            got = client.submit_group(
                step.step_id, [x[rows] for x in case.inputs], case.mask[rows],
                segment_ids=None if case.ids is None else case.ids[rows],
                prefix_lengths=None if sp is None else [sp.prefix_lengths[b] for b in rows])
            batch_row.update({got.first_row + k: b for k, b in enumerate(rows)})
        summary = step.close()
    for (r, c), got in collectors.items():
        got.join(60)
        assert got.error is None, "%s: receiver %d/%d: %s" % (what, r, c, got.error)
        assert len(got.micro_batches) == summary.micro_batches_per_rank, what
    for c in range(receivers):
        seen = sorted(batch_row[s] for r in range(ranks)
                      for mb in collectors[(r, c)].micro_batches for s in mb.samples)
        assert seen == list(range(case.B)), "%s: every row once" % what
    for (r, c), got in collectors.items():
        sub_o = dataclasses.replace(o, cp_rank=c if o.cp_size > 1 else 0,
                                    sp_rank=c if o.sp_size > 1 else 0)
        for mb in got.micro_batches:
            rows = [batch_row[s] for s in mb.samples]
            if not rows:
                assert mb.result.total_active == 0, what
                continue
            sub = [x[rows] for x in case.inputs]
            ids = None if case.ids is None else [case.ids_lists[b] for b in rows]
            if o.shared is not None:
                groups, prefix, same, _ = o.shared
                sub_o = dataclasses.replace(sub_o, shared=(
                    tuple(groups[b] for b in rows), tuple(prefix[b] for b in rows), same, False))
            expect_pack(mb.result, case, [case.mask_lists[b] for b in rows], ids, sub, sub_o,
                        "%s: micro-batch %d of rank %d, receiver %d" % (what, mb.index, r, c))


def run(client, device, op, case, o, what, rng, gen):
    if op == "pack":
        run_pack(client, device, case, o, what)
    elif op == "scatter":
        run_scatter(client, device, case, o, what, gen)
    elif op == "stream":
        run_stream(client, device, case, o, what, rng)
    else:
        run_step(client, device, case, o, what, rng)


def expect_refused(client, device, op, case, o, what, rng, gen, message):
    """packd refuses the call with INVALID_ARGUMENT saying `message`."""
    with pytest.raises(packd.PackdError) as e:
        run(client, device, op, case, o, what, rng, gen)
    assert isinstance(e.value, ValueError), what
    assert message in e.value.details, "%s: %s" % (what, e.value.details)


_GPU = []


class OnGpu:
    """A client whose every call has its tensors in fake GPU memory (the gpu_memory backend):
    the tensor arguments are copied there, `device` is left to the tensors, and the results
    are the GPU's (fake device memory reads as host memory)."""

    def __init__(self, client):
        self._client = client

    @staticmethod
    def _put(t):
        if not _GPU:
            from fake_gpu_memory import FakeGpuMemory
            _GPU.append(FakeGpuMemory(os.environ["PACKD_FAKE_GPU_LIB"], devices=1))
        if t is None or not isinstance(t, torch.Tensor):
            return t
        return _GPU[0].put(t.contiguous(), 0)

    def _call(self, method, tensors, mask, **kwargs):
        kwargs.pop("device", None)
        for name in ("segment_ids", "loss_mask"):
            if name in kwargs:
                kwargs[name] = self._put(kwargs[name])
        tensors = ([self._put(t) for t in tensors] if isinstance(tensors, (list, tuple))
                   else self._put(tensors))
        return getattr(self._client, method)(tensors, self._put(mask), **kwargs)

    @staticmethod
    def _on_gpu(result):
        first = result[0] if isinstance(result, (list, tuple)) else result
        # (An empty tensor has no address to tell apart.)
        assert first.numel() == 0 or _GPU[0].device_of(first) == 0, \
            "a result of the GPU path in host memory"
        return result

    def pack(self, tensors, mask, **kwargs):
        r = self._call("pack", tensors, mask, **kwargs)
        self._on_gpu(r.packed)
        return r

    def scatter(self, tensors, mask, **kwargs):
        return self._on_gpu(self._call("scatter", tensors, mask, **kwargs))

    def pack_micro_batches(self, tensors, mask, budget, **kwargs):
        return self._call("pack_micro_batches", tensors, mask, max_tokens=budget, **kwargs)


@contextlib.contextmanager
def connect(address, device):
    """The client of a backend: for gpu_memory, one over fake GPU memory (OnGpu)."""
    if device != "gpu_memory":
        with packd.Client(address,
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as client:
            yield client
        return
    OnGpu._put(None)  # the fake GPU, before the client that uses it
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0),
                      gpu=packd.GpuOptions(device_memory=_GPU[0])) as client:
        yield OnGpu(client)


def skip_streamed_device_memory(op, backend):
    if op == "stream" and backend == "gpu_memory":
        pytest.skip("a streaming step's groups come inline or in shared memory, not in device "
                    "memory (packd refuses those, FAILED_PRECONDITION)")


def seeded(*names):
    """A random.Random and a torch.Generator for one test, from the run's seed."""
    rng = random.Random(" ".join(str(n) for n in (SEED,) + names))
    return rng, torch.Generator().manual_seed(rng.randrange(1 << 62))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_every_layout_combination(servers, op, backend):
    skip_streamed_device_memory(op, backend)
    address, device = servers[backend]
    rng, gen = seeded(op, backend)
    coverage = COVERAGE[(op, backend)]
    ran, refused_keys, widths = set(), set(), set()
    width_cycle = sorted(ROWS)
    with connect(address, device) as client:
        for cell in cells(op):
            # The widths cycle over the combinations served, so that each is served.
            width = width_cycle[sum(coverage[key] for key in ran - refused_keys)
                                % len(width_cycle)]
            case = Case(rng, gen, cell, width, op)
            what = "PACKD_ORACLE_SEED=%d %s on %s, %s, B %d S %d, %s" % (
                SEED, op, backend, key_of(cell), case.B, case.S, case.options)
            o = case.model_options(op)
            try:
                case_call(op, case, o)
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
                refused_keys.add(key_of(cell))
        # Every combination ran, and every row width.
        assert ran == {key_of(cell) for cell in cells(op)}, sorted(ran)
        assert REQUIRED_WIDTHS <= widths, widths
        # The server serves on after every refusal.
        x = torch.arange(6).view(1, 6)
        assert client.pack(x, torch.ones(1, 6), device=device).packed.tolist() == list(range(6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_refused_combinations_name_their_field(servers, op, backend):
    skip_streamed_device_memory(op, backend)
    address, device = servers[backend]
    rng, gen = seeded("refused", op, backend)
    coverage = COVERAGE[(op, backend)]
    with connect(address, device) as client:
        for name, options, message in REFUSED:
            if op == "stream" and (options.get("cp_rank") or options.get("sp_rank")):
                continue  # a stream's receivers name their own (test_streaming_step.py)
            case = Case(rng, gen, PLAIN, 8, op)
            case.options = dict(options)
            o = case.model_options(op)
            with pytest.raises(Refused, match=None) as model:
                layout(case.mask_lists, case.ids_lists, o, len(case.inputs))
            assert message in str(model.value), name
            expect_refused(client, device, op, case, o, name, rng, gen, message)
            coverage["refused " + name] += 1


# -- §14: shared prompts, many random groupings, and every error --------------------------------

# The combinations a shared prefix is defined with: no documents, padding, CP, SP or fixed.
SHARED_CELLS = {op: [c for c in cells(op) if is_shared(c) and not (
    c["docs"] or c["pad"] or c["parallel"] != "none" or c["fixed"])] for op in OPS}
SHARED_REPEATS = 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_shared_prompts(servers, op, backend):
    """Random groups (ids in any order, groups of one, prompts of 0 and of a whole row, empty
    rows), shifts in target space, seq_idx, position ids and same_inputs, each against the
    model."""
    skip_streamed_device_memory(op, backend)
    address, device = servers[backend]
    rng, gen = seeded("shared", op, backend)
    coverage = COVERAGE[(op, backend)]
    with connect(address, device) as client:
        for n in range(SHARED_REPEATS):
            for cell in SHARED_CELLS[op]:
                case = Case(rng, gen, cell, sorted(ROWS)[n % len(ROWS)], op)
                what = "PACKD_ORACLE_SEED=%d shared %s on %s, %s, B %d S %d, %s" % (
                    SEED, op, backend, key_of(cell), case.B, case.S, case.options)
                o = case.model_options(op)
                case_call(op, case, o)  # defined: the model lays it out
                run(client, device, op, case, o, what, rng, gen)
                coverage["shared " + key_of(cell)] += 1
    assert sum(v for k, v in coverage.items() if k.startswith("shared ")) == (
        SHARED_REPEATS * len(SHARED_CELLS[op]))


def _prompts_equal(case, sp):
    """inputs[0] as int64 with every member's prompt its group's first row's."""
    x = random_tensor(torch.int64, (case.B, case.S), None)
    for b, g in enumerate(sp.groups):
        f = list(sp.groups).index(g)
        x[b, :sp.prefix_lengths[b]] = x[f, :sp.prefix_lengths[b]]
    case.inputs[0] = x
    return x


def _prompt_differs(sp, case, rng):
    x = _prompts_equal(case, sp)
    b = rng.randrange(1, case.B)
    x[b, rng.randrange(sp.prefix_lengths[b])] ^= 1
    return sp


# name, the ops, and how a valid shared prefix (one group of the full rows, prompt 1 .. S) is
# made bad; the model says what packd must.
SHARED_REFUSED = [
    ("targets in a Pack", ("pack", "step", "stream"), lambda sp, case, rng:
        dataclasses.replace(sp, targets=True)),
    # (A streaming step's groups and prefix arrays are its own, one per group submitted.)
    ("groups too long", ("pack", "scatter", "step"), lambda sp, case, rng: dataclasses.replace(
        sp, groups=list(sp.groups) + [1])),
    ("prefix_lengths too short", ("pack", "scatter", "step"), lambda sp, case, rng:
        dataclasses.replace(sp, prefix_lengths=list(sp.prefix_lengths)[:-1])),
    ("negative prefix", OPS, lambda sp, case, rng: dataclasses.replace(
        sp, prefix_lengths=[-1] * case.B)),
    ("prefixes differ in a group", OPS, lambda sp, case, rng: dataclasses.replace(
        sp, prefix_lengths=list(sp.prefix_lengths)[:-1] + [sp.prefix_lengths[-1] - 1])),
    ("prefix longer than its row", OPS, lambda sp, case, rng: dataclasses.replace(
        sp, prefix_lengths=[case.S + 1] * case.B)),
    ("same_inputs names no input", OPS, lambda sp, case, rng: dataclasses.replace(
        sp, same_inputs=[len(case.inputs) + 2])),
    ("a prompt differs", ("pack", "step", "stream"), _prompt_differs),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_refused_shared_prompts(servers, op, backend):
    """Every §14 error is INVALID_ARGUMENT with what the model says (the field, the row or
    group, the first differing prompt token), and the server serves the next call; with
    documents, padding, CP, SP or fixed the cross product above checks the refusal."""
    skip_streamed_device_memory(op, backend)
    address, device = servers[backend]
    rng, gen = seeded("shared refused", op, backend)
    coverage = COVERAGE[(op, backend)]
    cell = dict(PLAIN, shared="stream" if op == "scatter" else True)
    with connect(address, device) as client:
        for name, ops, spoil in SHARED_REFUSED:
            if op not in ops:
                continue
            case = Case(rng, gen, cell, 8, op, kind="full", rows=rng.randint(2, 6))
            P = rng.randint(1, case.S)
            good = packd.SharedPrefix([5] * case.B, [P] * case.B, (0,) if op != "scatter"
                                      else ())
            if op != "scatter":
                case.options.pop("pad_values", None)  # inputs[0] becomes int64
                _prompts_equal(case, good)
            case.options["shared_prefix"] = spoil(good, case, rng)
            o = case.model_options(op)
            with pytest.raises(Refused) as model:
                case_call(op, case, o)
            what = "PACKD_ORACLE_SEED=%d %s on %s: %s" % (SEED, op, backend, name)
            message = str(model.value)
            if op == "stream":  # the group submitted is the request's only group, 0
                message = re.sub(r"group -?\d+", "group 0", message)
            expect_refused(client, device, op, case, o, what, rng, gen, message)
            coverage["refused shared: " + name] += 1
        x = torch.arange(6).view(1, 6)
        assert client.pack(x, torch.ones(1, 6), device=device).packed.tolist() == list(range(6))
