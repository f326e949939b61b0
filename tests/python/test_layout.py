"""Layouts for parallel attention through the Python client (docs/design.md §10), against a
reference written from the rules with torch: padding, cu_seqlens_padded, position ids through the
padding, seq_idx, shifts that stop at every sequence's end, fixed shapes with a ghost, CP
slices, Ulysses (SP) slices and their Scatter; RemotePackOp's backward through the layout equal
to torch autograd; varlen_kwargs, Megatron's PackedSeqParams among them;
every error INVALID_ARGUMENT, the server serving after each."""
import dataclasses
import random

import pytest
import torch

import packd
from torch_reference import (DTYPES, gathered, random_tensor, reference_layout,
                             same)


@pytest.fixture
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c


def test_transformer_engines_worked_case(client):
    """Two sequences of 8, cp 2: rank 0 holds rows 0, 1, 6, 7, 8, 9, 14, 15."""
    mask = torch.ones(2, 8, dtype=torch.bool)
    x = torch.arange(16, dtype=torch.int64).view(2, 8, 1)
    r0 = client.pack(x, mask, layout=packd.Layout(pad_multiple=4, cp_size=2, cp_rank=0),
                     with_position_ids=True)
    assert r0.packed.flatten().tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert r0.position_ids.tolist() == [0, 1, 6, 7, 0, 1, 6, 7]
    assert r0.cu_seqlens_padded.tolist() == [0, 8, 16] and r0.max_seqlen_padded == 8
    r1 = client.pack(x, mask, layout=packd.Layout(pad_multiple=4, cp_size=2, cp_rank=1))
    assert r1.packed.flatten().tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_shifted_labels_stop_at_the_document_boundary(client):
    mask = torch.ones(1, 5, dtype=torch.bool)
    ids = torch.tensor([[7, 7, 7, 9, 9]], dtype=torch.int32)
    tokens = torch.tensor([[10, 11, 12, 20, 21]])
    r = client.pack(tokens.unsqueeze(2), mask, segment_ids=ids,
                    layout=packd.Layout(shifts=[(0, -100)]))
    assert r.shifted[0].flatten().tolist() == [11, 12, -100, 21, -100]


@pytest.mark.parametrize("trial", range(12))
def test_random_layouts_match_the_reference(client, trial):
    rng = random.Random(trial)
    gen = torch.Generator().manual_seed(trial)
    B, S = rng.randint(1, 5), rng.randint(1, 20)
    mask = torch.rand(B, S, generator=gen) < [0.0, 0.5, 1.0][trial % 3]
    ids = torch.randint(0, 3, (B, S), generator=gen) if trial % 2 else None
    dtype = DTYPES[trial % len(DTYPES)]
    x = random_tensor(dtype, (B, S, 2), gen)
    tok = torch.randint(0, 1000, (B, S), generator=gen)
    cp = 1 + trial % 3
    m = 2 * cp * rng.randint(1, 3)
    rank = rng.randrange(cp)
    _, _, _, _, cu = reference_layout(mask, ids, m, cp, rank)
    tokens = cu[-1] + m * (trial % 2) if trial % 4 < 2 else 0
    fixed = (tokens, 0, tokens) if tokens else None
    rows, shifted, pos, seq_idx, cu = reference_layout(mask, ids, m, cp, rank, tokens)
    pad = 1 if dtype == torch.bool else 5
    r = client.pack([x, tok.unsqueeze(2)], mask, segment_ids=ids, with_position_ids=True,
                    layout=packd.Layout(pad_multiple=m, cp_size=cp, cp_rank=rank, with_seq_idx=True,
                                        pad_values=[pad, -1], shifts=[(1, -100)], fixed=fixed),
                    cu_seqlens_dtype=torch.int32)
    assert same(r.packed[0], gathered(x, rows, pad))
    assert same(r.packed[1], gathered(tok.unsqueeze(2), rows, -1))
    assert same(r.shifted[0], gathered(tok.unsqueeze(2), shifted, -100))
    assert r.position_ids.tolist() == pos and r.seq_idx.tolist() == seq_idx
    assert r.cu_seqlens_padded.tolist() == cu and r.cu_seqlens_padded.dtype == torch.int32
    assert r.total_active == int((mask != 0).sum())


def test_remote_pack_op_backward_through_the_layout_is_torch_autograd(address):
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 11, generator=gen) < 0.6
    ids = torch.randint(0, 2, (3, 11), generator=gen)
    layout = packd.Layout(pad_multiple=8, cp_size=2, cp_rank=1)
    op = packd.RemotePackOp(address, layout=layout,
                             shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    x = torch.randn(3, 11, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    packed, _ = op(x, mask, segment_ids=ids)
    rows, *_ = reference_layout(mask, ids, 8, 2, 1)
    assert same(packed.detach(), gathered(x.detach(), rows, 0))
    weight = torch.randn(packed.shape, dtype=torch.float64, generator=gen)
    (packed * weight).sum().backward()
    # torch autograd through the reference pack.
    ref_x = x.detach().clone().requires_grad_()
    index = torch.tensor(rows)
    ref = ref_x.reshape(33, 4)[index.clamp(min=0)] * (index >= 0).unsqueeze(1)
    (ref * weight).sum().backward()
    assert same(x.grad, ref_x.grad)
    op.close()


@pytest.mark.parametrize("trial", range(8))
def test_ulysses_slices_match_the_reference(client, trial):
    """Each SP rank's contiguous slice of the layout, padded to a multiple of sp_size by a
    trailing ghost; Scatter puts a rank's rows back and drops the rest."""
    rng = random.Random(trial)
    gen = torch.Generator().manual_seed(100 + trial)
    B, S = rng.randint(1, 5), rng.randint(1, 20)
    mask = torch.rand(B, S, generator=gen) < 0.6
    ids = torch.randint(0, 3, (B, S), generator=gen) if trial % 2 else None
    tok = torch.randint(0, 1000, (B, S, 1), generator=gen)
    u, m = 2 + trial % 3, [0, 1, 4][trial % 3]
    for r in range(u):
        rows, shifted, pos, seq_idx, cu = reference_layout(mask, ids, m, sp=u, sp_rank=r)
        got = client.pack(
            tok, mask, segment_ids=ids, layout=packd.Layout(pad_multiple=m, sp_size=u, sp_rank=r,
                                                            with_seq_idx=True, shifts=[(0, -100)]),
            with_position_ids=True)
        assert same(got.packed, gathered(tok, rows, 0))
        assert same(got.shifted[0], gathered(tok, shifted, -100))
        assert got.position_ids.tolist() == pos and got.seq_idx.tolist() == seq_idx
        assert got.cu_seqlens_padded.tolist() == cu and cu[-1] % u == 0
        dense = client.scatter(got.packed, mask, segment_ids=ids,
                               layout=packd.Layout(pad_multiple=m, sp_size=u, sp_rank=r))
        flat = torch.zeros(B * S, 1, dtype=tok.dtype)
        keep = [p for p in rows if p >= 0]
        flat[keep] = tok.reshape(B * S, 1)[keep]
        assert same(dense, flat.view(B, S, 1))


def test_megatron_kwargs_are_packed_seq_params_fields(client):
    """style="megatron" builds Megatron-Core's PackedSeqParams (its fields, from
    megatron/core/packed_seq_params.py: the package is not installable here)."""

    @dataclasses.dataclass
    class PackedSeqParams:
        qkv_format: str = None
        cu_seqlens_q: torch.Tensor = None
        cu_seqlens_kv: torch.Tensor = None
        cu_seqlens_q_padded: torch.Tensor = None
        cu_seqlens_kv_padded: torch.Tensor = None
        max_seqlen_q: int = None
        max_seqlen_kv: int = None
        local_cp_size: int = None
        cp_group: object = None
        total_tokens: int = None

    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([[0, 0, 0, 1, 1, 0], [5, 5, 0, 0, 0, 0]])
    x = torch.randn(2, 6, 3)
    plain = PackedSeqParams(**packd.varlen_kwargs(client.pack(x, mask), style="megatron"))
    assert plain.qkv_format == "thd" and plain.total_tokens == 7
    assert plain.cu_seqlens_q.dtype == torch.int32
    assert plain.cu_seqlens_q.tolist() == plain.cu_seqlens_q_padded.tolist() == [0, 5, 7]
    assert plain.max_seqlen_q == plain.max_seqlen_kv == 5
    # Documents, CP padding and Megatron RL's CUDA-graph shapes: 3 documents padded to 4 in
    # 16 rows (a ghost of 4), the cu arrays N + 1 = 7 entries, zero-length ghosts repeating.
    r = client.pack(x, mask, segment_ids=ids, layout=packd.Layout(pad_multiple=4, cp_size=2,
                                                                  cp_rank=0, fixed=(16, 6, 16)))
    kw = packd.varlen_kwargs(r, style="megatron")
    p = PackedSeqParams(**kw)
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 3, 5, 7, 7, 7, 7]
    assert p.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12, 16, 16, 16]
    assert p.cu_seqlens_kv_padded.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 16
    assert p.total_tokens == 16 and r.packed.shape[0] == 8  # this CP rank's half
    assert set(kw) == {f.name for f in dataclasses.fields(PackedSeqParams)} - {
        "local_cp_size", "cp_group"}


def test_varlen_kwargs_for_transformer_engine_and_flash_attention(client):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    x = torch.randn(2, 4, 3)
    r = client.pack(x, mask, layout=packd.Layout(pad_multiple=4))
    te = packd.varlen_kwargs(r, style="te")
    assert te["cu_seqlens_q"].tolist() == [0, 3, 5] and te["cu_seqlens_q"].dtype == torch.int32
    assert te["cu_seqlens_kv_padded"].tolist() == [0, 4, 8]
    assert te["max_seqlen_q"] == 4 and te["max_seqlen_kv"] == 4
    with pytest.raises(ValueError, match="pad rows"):
        packd.varlen_kwargs(r)
    plain = packd.varlen_kwargs(client.pack(x, mask))
    assert plain["cu_seqlens_k"].tolist() == [0, 3, 5] and plain["max_seqlen_k"] == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(pad_multiple=-1), "pad_multiple -1 is negative"),
    (dict(cp_size=2, pad_multiple=6), "pad_multiple 6 is not a multiple of 2 * cp_size = 4"),
    (dict(cp_size=2, pad_multiple=4, cp_rank=3), "cp_rank 3 is not in [0, cp_size = 2)"),
    (dict(pad_values=[1, 2, 3]), "pad_values has 3 values but there are 2 inputs"),
    (dict(pad_values=[0, 0.5]), "pad_values[1] 0.5 is not a value of int64"),
    (dict(shifts=[(2, 0)]), "shifts[0].input 2 names no input"),
    (dict(pad_multiple=4, fixed=(6, 0, 0)), "fixed.tokens 6 is less than the 8 padded tokens"),
    (dict(pad_multiple=4, fixed=(8, 0, 2)), "fixed.max_seqlen 2 is less than 4"),
    (dict(sp_size=-2), "sp_size -2 is negative"),
    (dict(sp_size=2, sp_rank=2), "sp_rank 2 is not in [0, sp_size = 2)"),
    (dict(sp_rank=1), "sp_rank 1 needs sp_size > 1"),
    (dict(sp_size=2, cp_size=2, pad_multiple=4), "sp_size 2 and cp_size 2 are both set"),
    (dict(sp_size=4, fixed=(6, 0, 0)), "fixed.tokens 6 is not a multiple of sp_size 4"),
])
def test_every_error_is_invalid_argument_and_the_server_keeps_serving(client, kwargs, message):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    x, tok = torch.randn(2, 4, 3), torch.arange(8).view(2, 4)
    with pytest.raises(packd.PackdError) as e:
        client.pack([x, tok], mask, layout=packd.Layout(**kwargs))
    assert isinstance(e.value, ValueError) and message in e.value.details
    assert same(client.pack(x, mask).packed, x[mask])


def test_the_old_keywords_warn_name_their_replacement_and_give_the_same_results(client):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    x, ids = torch.randn(2, 4, 3), torch.tensor([[1, 1, 2, 2], [3, 3, 3, 3]])
    layout = packd.Layout(pad_multiple=4, shifts=[(0, 0)], with_seq_idx=True)
    new = client.pack(x, mask, segment_ids=ids, layout=layout)
    with pytest.warns(packd.PackdDeprecationWarning,
                      match=r"pack\(pad_multiple=\.\.\., shifts=\.\.\., with_seq_idx=\.\.\.\) "
                      r"is deprecated: pass layout=packd.Layout\("):
        old = client.pack(x, mask, segment_ids=ids, pad_multiple=4, shifts=[(0, 0)],
                          with_seq_idx=True)
    assert same(old.packed, new.packed) and same(old.shifted[0], new.shifted[0])
    assert same(old.seq_idx, new.seq_idx)
    # Scatter reads the fields that place rows; the same Layout inverts its Pack.
    dense = client.scatter(new.packed, mask, segment_ids=ids, layout=layout)
    with pytest.warns(packd.PackdDeprecationWarning, match="layout=packd.Layout"):
        old_dense = client.scatter(new.packed, mask, segment_ids=ids, pad_multiple=4)
    assert same(dense, old_dense) and same(dense[mask], x[mask])
    plan = packd.PlanOptions(num_ranks=2, cost=(1, 0))
    with pytest.warns(packd.PackdDeprecationWarning, match=r"plan=packd.PlanOptions\("):
        old_step = client.pack_micro_batches(x, mask, 8, num_ranks=2, cost=(1, 0),
                                             layout=packd.Layout(pad_multiple=4))
    new_step = client.pack_micro_batches(x, mask, 8, plan=plan,
                                         layout=packd.Layout(pad_multiple=4))
    assert old_step.plan == new_step.plan
    assert [same(a.result.packed, b.result.packed) for a, b in zip(old_step, new_step)] == [
        True] * len(new_step.plan.micro_batches)
    # The plan alone, from lengths: the same PlanOptions.
    lengths = [5, 900, 37, 1200, 64, 8]
    plan = packd.PlanOptions(num_ranks=2, cost=(3, 1), groups=[0, 0, 1, 2, 2, 3],
                             pipeline_order=True)
    with pytest.warns(packd.PackdDeprecationWarning,
                      match=r"plan_micro_batches\(cost=\.\.\., groups=\.\.\., num_ranks=\.\.\., "
                      r"pipeline_order=\.\.\.\) is deprecated: pass plan=packd.PlanOptions\("):
        old_plan = client.plan_micro_batches(lengths, 1300, num_ranks=2, cost=(3, 1),
                                             groups=[0, 0, 1, 2, 2, 3], pipeline_order=True)
    assert old_plan == client.plan_micro_batches(lengths, 1300, plan=plan)


def test_the_old_keywords_beside_their_object_or_unknown_ones_are_refused(address):
    mask = torch.ones(1, 2, dtype=torch.bool)
    with packd.Client(address) as client:
        with pytest.raises(ValueError, match="give layout= or the keywords pad_multiple"):
            client.pack(torch.ones(1, 2), mask, layout=packd.Layout(), pad_multiple=2)
        with pytest.raises(TypeError, match="unexpected keyword argument 'pad_multipel'"):
            client.pack(torch.ones(1, 2), mask, pad_multipel=2)
        with pytest.raises(TypeError, match="'with_seq_idx'"):
            client.scatter(torch.ones(2), mask, with_seq_idx=True)
        with pytest.raises(ValueError, match="groups and pipeline_order"):
            client.open_step(8, plan=packd.PlanOptions(groups=[0]))
        with pytest.raises(ValueError, match="give plan= or the keywords num_ranks"):
            client.plan_micro_batches([1, 2], 8, plan=packd.PlanOptions(), num_ranks=2)
        with pytest.raises(ValueError, match="give plan.cost=.* or costs=, not both"):
            client.plan_micro_batches([1, 2], 8, plan=packd.PlanOptions(cost=(1, 1)),
                                      costs=[1, 2])
    with pytest.warns(packd.PackdDeprecationWarning,
                      match=r"shared_memory=packd.SharedMemoryOptions\(threshold_bytes=\.\.\.\)"):
        packd.Client(address, shm_threshold_bytes=0).close()
    with pytest.raises(ValueError, match="give tls= or the keywords tls_ca_file"):
        packd.Client(address, tls=packd.TlsOptions(), tls_ca_file="ca.pem")
    with pytest.raises(TypeError, match="unexpected keyword argument 'shm_threshold'"):
        packd.Client(address, shm_threshold=0)


def test_a_layout_read_back_from_its_pack_request_is_itself():
    from packd.v1 import pack_service_pb2 as pb
    layouts = [
        packd.Layout(),
        packd.Layout(pad_multiple=8, pad_values=[1.5, -2.0], cp_size=2, cp_rank=1,
                     with_seq_idx=True, shifts=[(0, -100), (1, 0.5)], fixed=(64, 4, 32),
                     with_token_mask=True),
        packd.Layout(sp_size=4, sp_rank=3, shifts=[(0, -100)]),
        packd.Layout(shared_prefix=packd.SharedPrefix([0, 0, 1], [3, 3, 5], (0,))),
        packd.Layout(mrope=packd.MRope(7, 8, [(1, 2, 2), (2, 4, 4)], 2, 6, 2.0, (0.5,), 1)),
    ]
    for layout in layouts:
        message = pb.PackRequest()
        layout.to_pack(message)
        assert packd.Layout.of(message) == layout


def test_a_rank_reads_with_the_steps_layout_and_the_old_keywords_warn(address):
    with packd.Client(address) as client:
        with client.open_step(8) as step:
            with pytest.warns(packd.PackdDeprecationWarning,
                              match="layout, with_position_ids are no longer needed"):
                stream = client.receive_step(step.step_id, 0, layout=packd.Layout(),
                                             with_position_ids=True)
            with pytest.raises(TypeError, match="unexpected keyword argument 'layuot'"):
                client.receive_step(step.step_id, 1, layuot=packd.Layout())
            stream.cancel()
            step.cancel()
