"""packd's Python client against the real server: every dtype, the op's contract through
RemotePackOp (forward and backward, non-bool masks, both fast paths, tails, validation, unpack),
shared memory against inline, errors."""
import glob
import os
import random
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

import packd
from packd_server import PackdServer, unused_port
from torch_reference import DTYPES, bits, random_tensor, reference_scatter, same

@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c


@pytest.fixture(scope="module")
def op(address):
    op = packd.RemotePackOp(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    yield op
    op.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(client, dtype):
    mask = torch.rand(4, 37) < 0.5
    x = random_tensor(dtype, (4, 37, 3))
    r = client.pack(x, mask, with_position_ids=True, cu_seqlens_dtype=torch.int32)
    assert same(x[mask], r.packed)
    counts = mask.sum(1)
    assert r.cu_seqlens.dtype == torch.int32
    assert r.cu_seqlens.tolist() == [0] + counts.cumsum(0).tolist()
    assert r.total_active == int(counts.sum()) and r.max_seqlen == int(counts.max())
    assert r.position_ids.tolist() == (mask.long().cumsum(1) - 1)[mask].tolist()
    dense = client.scatter(r.packed, mask)
    assert same(reference_scatter(bits(x)[mask].view(x.dtype), mask, x), dense)


def test_several_tensors_share_one_mask(client):
    mask = torch.rand(3, 20) < 0.6
    xs = [random_tensor(d, (3, 20, 2)) for d in DTYPES]
    r = client.pack(xs, mask)
    assert isinstance(r.packed, list) and len(r.packed) == len(xs)
    for x, p in zip(xs, r.packed):
        assert same(x[mask], p)


# The op's contract, through RemotePackOp.

def test_forward_and_backward_correctness(op):
    mask = torch.rand(4, 50) < 0.4
    x = torch.randn(4, 50, 8, requires_grad=True)
    packed, cu_seqlens = op(x, mask)
    assert torch.equal(packed, x.detach()[mask])
    assert cu_seqlens.dtype == torch.int64
    assert cu_seqlens.tolist() == [0] + mask.sum(1).cumsum(0).tolist()
    g = torch.randn_like(packed)
    packed.backward(g)
    expected = torch.zeros_like(x)
    expected[mask] = g
    assert same(expected, x.grad)


def test_gradcheck_float64(op):
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: op(t, mask)[0], (x,))


@pytest.mark.parametrize("mask_dtype", [torch.uint8, torch.int64, torch.float32, torch.bfloat16])
def test_non_boolean_masks(op, mask_dtype):
    values = torch.tensor([[0.0, 2.0, -0.0, 1.0], [float("nan"), 0.0, 3.0, -0.0]])
    if not mask_dtype.is_floating_point:
        values = torch.nan_to_num(values, nan=5.0)
    mask = values.to(mask_dtype)
    x = torch.randn(2, 4, 2)
    packed, cu = op(x, mask)
    active = mask != 0
    assert torch.equal(packed, x[active])
    assert cu.tolist() == [0] + active.sum(1).cumsum(0).tolist()


def test_all_active_and_none_active_fast_paths_and_their_backward(op):
    for fill in (True, False):
        mask = torch.full((3, 5), fill)
        x = torch.randn(3, 5, 4, requires_grad=True)
        packed, cu = op(x, mask)
        assert packed.shape == ((15, 4) if fill else (0, 4))
        assert cu.tolist() == ([0, 5, 10, 15] if fill else [0, 0, 0, 0])
        packed.backward(torch.ones_like(packed))
        assert torch.equal(x.grad, torch.full_like(x, 1.0 if fill else 0.0))


def _losses():
    """Losses whose gradients reach packed as the shapes autograd makes: expanded (stride 0, also
    when empty), transposed, and plain."""
    return {
        "sum (expanded)": lambda p: p.sum(),
        "transposed": lambda p: (p.t() * torch.arange(p.numel(), dtype=p.dtype)
                                 .reshape(p.t().shape)).sum(),
        "weighted (contiguous)": lambda p: (p * torch.linspace(-1, 1, p.numel(), dtype=p.dtype)
                                            .reshape(p.shape)).sum(),
    }


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shared-memory"])
def test_backward_of_empty_tensors_and_strided_gradients(address, shm):
    """Every combination of empty tensors (no active row, B = 0, S = 0, an empty tail) and
    expanded or non-contiguous gradients: x.grad equals torch's own, bit for bit."""
    op = packd.RemotePackOp(
        address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=1 if shm else 0))
    try:
        for shape in [(2, 4, 8), (0, 4, 8), (2, 0, 8), (2, 4, 0)]:
            for fill in ("none", "all", "random"):
                mask = {"none": torch.zeros(shape[:2], dtype=torch.bool),
                        "all": torch.ones(shape[:2], dtype=torch.bool),
                        "random": torch.rand(shape[:2]) < 0.5}[fill]
                for name, loss in _losses().items():
                    x = torch.randn(shape, requires_grad=True)
                    ref = x.detach().clone().requires_grad_()
                    packed, _ = op(x, mask)
                    loss(packed).backward()
                    loss(ref[mask]).backward()
                    where = f"x {list(shape)}, {fill} active, {name}"
                    assert x.grad is not None, where
                    assert same(x.grad, ref.grad), where
        # unpack takes the same strided and empty tensors.
        empty = torch.zeros(1, 8).expand(0, 8)
        out = op.unpack(empty, torch.zeros(2, 4, dtype=torch.bool))
        assert out.shape == (2, 4, 8) and not out.any()
    finally:
        op.close()


def test_multi_dimensional_tails(op):
    mask = torch.rand(2, 9) < 0.5
    x = torch.randn(2, 9, 3, 4, 2)
    packed, _ = op(x, mask)
    assert torch.equal(packed, x[mask])
    assert torch.equal(op.unpack(packed, mask), torch.where(mask[..., None, None, None], x,
                                                          torch.zeros(())))


def test_mask_and_tail_shape_validation(op):
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"mask.shape \[8\] must have rank 2"):
        op(x, torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"does not start with mask shape \[2, 5\]"):
        op(x, torch.ones(2, 5, dtype=torch.bool))
    packed, _ = op(x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"tail_shape \[4\] does not match"):
        op.unpack(packed, torch.ones(2, 4, dtype=torch.bool), tail_shape=(4,))
    with pytest.raises(ValueError, match="not one packd carries"):
        op(torch.zeros(2, 4, dtype=torch.complex64), torch.ones(2, 4, dtype=torch.bool))


def test_unpack_round_trip(op):
    mask = torch.rand(5, 30) < 0.3
    x = torch.randn(5, 30, 6)
    packed, _ = op(x, mask)
    dense = op.unpack(packed, mask, tail_shape=(6,))
    assert torch.equal(dense[mask], x[mask])
    assert torch.count_nonzero(dense[~mask]) == 0


def test_a_normal_exit_after_shared_memory_calls_prints_nothing(address):
    """16 calls through shared memory, then the interpreter exits: nothing on stderr (no
    resource_tracker traceback per segment), and nothing left in /dev/shm."""
    script = f"""
import torch, packd
for i in range(16):  # a client, and so a segment, per call; the last left open
    client = packd.Client({address!r},
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=1))
    x = torch.randn(4, 64, 32)
    mask = torch.rand(4, 64) < 0.5
    assert torch.equal(client.pack(x, mask).packed, x[mask])
    if i < 15:
        client.close()
"""
    before = set(os.listdir("/dev/shm"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == ""
    assert not [n for n in set(os.listdir("/dev/shm")) - before if "_py_" in n]


def test_shared_memory_and_inline_give_identical_bytes(address, client):
    before = set(glob.glob("/dev/shm/packd_py_*"))
    with packd.Client(address,
                      shared_memory=packd.SharedMemoryOptions(threshold_bytes=1)) as shm_client:
        for dtype in DTYPES:
            mask = torch.rand(6, 128) < 0.4
            x = random_tensor(dtype, (6, 128, 5))
            a, b = shm_client.pack(x, mask), client.pack(x, mask)
            assert same(a.packed, b.packed)
            assert same(shm_client.scatter(a.packed, mask), client.scatter(b.packed, mask))
        assert shm_client._regions.idle  # the handle path was taken
        regions = [r.name for r in client._stub.ListRegions(packd.client.pb.ListRegionsRequest()).regions]
        assert all(seg.region in regions for seg in shm_client._regions.idle)
        # Unlinked once the server mapped it: nothing to leak if this process is killed.
        assert set(glob.glob("/dev/shm/packd_py_*")) == before
    # Closed: unregistered.
    assert set(glob.glob("/dev/shm/packd_py_*")) == before
    assert list(client._stub.ListRegions(packd.client.pb.ListRegionsRequest()).regions) == []


def test_dns_addresses_default_to_round_robin():
    """dns:/// (a headless Kubernetes Service) balances over every address; calls work."""
    port = unused_port()
    with PackdServer(f"--listen=127.0.0.1:{port}"):
        for address, policy in [(f"dns:///127.0.0.1:{port}", "round_robin"),
                                (f"127.0.0.1:{port}", None)]:
            with packd.Client(address,
                              shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
                assert c.load_balancing_policy == policy
                assert c.info().version


def test_transport_errors_carry_the_grpc_code():
    with packd.Client("127.0.0.1:1", retries=1, timeout=5) as c:
        with pytest.raises(packd.PackdError) as err:
            c.pack(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert not isinstance(err.value, ValueError)


def test_absent_device_is_failed_precondition(client):
    with pytest.raises(packd.PackdError) as err:
        client.pack(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), device="cuda:0")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_device_slice_follows_the_ipc_offset_rule():
    # A tensor 256 bytes into a storage that starts 1 MiB into its allocation: the slice is at
    # the tensor's offset from the allocation's start.
    assert packd.device_slice(1 << 20, 4096, 256, 1024) == ((1 << 20) + 256, 1024)
    assert packd.device_slice(0, 4096, 0, 4096) == (0, 4096)
    with pytest.raises(ValueError):
        packd.device_slice(0, 4096, 3584, 1024)


def test_plan_micro_batches(client):
    lengths = [100, 2000, 3000, 50, 4096, 700, 10, 1500] * 8
    plan = client.plan_micro_batches(
        lengths, 4096, plan=packd.PlanOptions(num_ranks=2, micro_batch_multiple=2))
    seen = sorted(i for mb in plan.micro_batches for i in mb.samples)
    assert seen == list(range(len(lengths)))
    assert plan.global_loss_tokens == sum(lengths)
    assert len(plan.micro_batches) == 2 * plan.micro_batches_per_rank
    assert plan.micro_batches_per_rank % 2 == 0
    for mb in plan.micro_batches:
        assert mb.tokens == sum(lengths[i] for i in mb.samples)
        assert mb.tokens <= 4096 or len(mb.samples) == 1
    with pytest.raises(packd.PackdError) as e:
        client.plan_micro_batches([1, -1], 10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_plan_micro_batches_by_cost(client):
    rng = random.Random()
    lengths = [rng.randint(1, 6000) for _ in range(300)]
    groups = [i // 2 for i in range(300)]  # pairs
    loss = [0 if i % 5 == 0 else n for i, n in enumerate(lengths)]
    kwargs = dict(plan=packd.PlanOptions(num_ranks=4, cost=(24576, 1), groups=groups,
                                         pipeline_order=True),
                  pad_multiple=8, loss_tokens=loss)
    plan = client.plan_micro_batches(lengths, 16384, **kwargs)
    assert plan == client.plan_micro_batches(lengths, 16384, **kwargs)  # deterministic
    seen = sorted(i for mb in plan.micro_batches for i in mb.samples)
    assert seen == list(range(300))
    padded = [(n + 7) // 8 * 8 for n in lengths]
    for mb in plan.micro_batches:
        assert mb.padded_tokens == sum(padded[i] for i in mb.samples)
        assert mb.padded_tokens <= 16384
        assert mb.cost == pytest.approx(sum(24576 * padded[i] + padded[i] ** 2
                                            for i in mb.samples), rel=1e-12)
        for i in mb.samples:
            assert (i ^ 1) in mb.samples  # a pair shares its micro-batch
    assert plan.global_sequences == sum(1 for v in loss if v > 0)
    assert plan.global_loss_tokens == sum(loss)
    assert plan.cost_imbalance < 1.01
    by_costs = client.plan_micro_batches(lengths, 16384, plan=packd.PlanOptions(num_ranks=2),
                                         costs=[float(n) ** 2 for n in lengths])
    assert by_costs.cost_imbalance >= 1.0
    with pytest.raises(ValueError):
        client.plan_micro_batches(lengths, 16384, plan=packd.PlanOptions(cost=(1, 1)),
                                  costs=[1.0] * 300)
    with pytest.raises(packd.PackdError) as e:
        client.plan_micro_batches([1, 2], 10, costs=[1.0, -1.0])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "costs[1] is -1" in e.value.details


def test_documents_and_varlen_kwargs(client):
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([[4, 4, 9, 4, 5, 5], [5, 5, 6, 0, 0, 0]], dtype=torch.int16)
    x = random_tensor(torch.bfloat16, (2, 6, 3))
    r = client.pack(x, mask, with_position_ids=True, segment_ids=ids,
                    cu_seqlens_dtype=torch.int32)
    assert same(x[mask], r.packed)
    assert r.doc_cu_seqlens.tolist() == [0, 3, 5, 7, 8]
    assert r.doc_cu_seqlens.dtype == torch.int32
    assert r.doc_row.tolist() == [0, 0, 1, 1]
    assert r.doc_last_index.tolist() == [3, 5, 1, 2]
    assert r.doc_max_seqlen == 3
    assert r.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 0]
    kw = packd.varlen_kwargs(r)
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 5, 7, 8] and kw["max_seqlen_k"] == 3
    assert kw["cu_seqlens_k"].dtype == torch.int32
    plain = client.pack(x, mask)
    assert plain.doc_cu_seqlens is None
    assert packd.varlen_kwargs(plain)["cu_seqlens_q"].tolist() == [0, 5, 8]
    with pytest.raises(ValueError):
        client.pack(x, mask, segment_ids=ids.float())


def test_split_calls_equal_one_call(address):
    """Large inline calls go as two halves of the rows on two connections: the joined result
    must be the one call's."""
    split = packd.Client(address, connection=packd.ConnectionOptions(split_threshold_bytes=1),
                         shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    whole = packd.Client(address, connection=packd.ConnectionOptions(split_threshold_bytes=0),
                         shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    for B in (2, 5):
        mask = torch.rand(B, 33) < 0.6
        mask[0] = False
        ids = torch.randint(0, 3, (B, 33))
        xs = [torch.randn(B, 33, 4), torch.randint(0, 100, (B, 33), dtype=torch.int64)]
        a = split.pack(xs, mask, with_position_ids=True, segment_ids=ids)
        b = whole.pack(xs, mask, with_position_ids=True, segment_ids=ids)
        for x, p in zip(xs, a.packed):
            assert torch.equal(p, x[mask])
        for field in ("cu_seqlens", "position_ids", "last_index", "doc_cu_seqlens", "doc_row",
                      "doc_last_index"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert (a.total_active, a.max_seqlen, a.doc_max_seqlen) == (
            b.total_active, b.max_seqlen, b.doc_max_seqlen)
        packed = torch.randn(a.total_active, 2, 3)
        dense = split.scatter(packed, mask)
        expected = torch.zeros(B, 33, 2, 3)
        expected[mask] = packed
        assert torch.equal(dense, expected)
    split.close()
    whole.close()


def test_bearer_token_from_file_or_environment(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens"
    tokens.write_text("py-token\n")
    with PackdServer("--auth_token_file=%s" % tokens) as address:
        mask = torch.ones(2, 3, dtype=torch.bool)
        x = torch.randn(2, 3, 4)
        monkeypatch.delenv("PACKD_TOKEN", raising=False)
        with packd.Client(address) as anonymous:
            with pytest.raises(packd.PackdError) as refused:
                anonymous.pack(x, mask)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with packd.Client(address, token=packd.TokenOptions(file=str(tokens))) as client:
            assert torch.equal(client.pack(x, mask).packed, x[mask])
            assert torch.equal(client.scatter(x[mask], mask), x)
        monkeypatch.setenv("PACKD_TOKEN", "py-token")
        with packd.Client(address, connection=packd.ConnectionOptions(
                split_threshold_bytes=1)) as client:  # both connections
            assert torch.equal(client.pack(x, mask).packed, x[mask])


def test_calls_lose_nothing_to_restarts():
    """While four clients call Pack and Scatter in a loop, the server is stopped with SIGTERM
    (it drains) and started again on the same address, three times: every call returns the exact
    result. Calls refused by the draining server (UNAVAILABLE), cancelled by gRPC as the server
    shuts down (CANCELLED), or made while it is down are retried until it is back."""
    port = unused_port()
    server = PackdServer(f"--listen=127.0.0.1:{port}")
    stop = threading.Event()
    failures, calls = [], []

    def work():
        # Retries for longer than any restart takes here: the default, about 5 s, covers one on
        # an idle machine, and other tests may run beside.
        with packd.Client(server.address,
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0),
                          retries=19) as client:
            while not stop.is_set():
                mask = torch.rand(4, 32) < 0.5
                x = random_tensor(torch.float32, (4, 32, 8))
                began = time.monotonic()
                try:
                    packed = client.pack(x, mask).packed
                    dense = client.scatter(packed, mask)
                    if not (same(packed, x[mask])
                            and same(dense, reference_scatter(x[mask], mask, x))):
                        failures.append("a wrong result")
                except packd.PackdError as e:
                    failures.append(f"{e} (at {began - t0:.1f} s, after "
                                    f"{time.monotonic() - began:.1f} s of retries)")
                calls.append(1)

    workers = [threading.Thread(target=work) for _ in range(4)]
    t0, restarts = time.monotonic(), []
    try:
        for t in workers:
            t.start()
        for _ in range(3):
            time.sleep(2.5)  # longer than the longest backoff: every client gets through
            began = time.monotonic()
            server.restart(graceful=True)
            restarts.append(f"{began - t0:.1f}-{time.monotonic() - t0:.1f} s")
        time.sleep(1.0)
    finally:
        stop.set()
        for t in workers:
            t.join()
        assert server.stop() == 0
    assert failures == [], (f"{len(failures)} of {len(calls)} calls failed; "
                            f"the server restarted at {', '.join(restarts)}")
    assert len(calls) > 50


def test_regions_come_back_after_their_lease_and_after_a_restart():
    """The scratch segment is leased; when the server drops it (lease run out, restart) the
    next call registers it again without the caller doing anything."""
    server = PackdServer()
    try:
        with packd.Client(
                server.address,
                shared_memory=packd.SharedMemoryOptions(threshold_bytes=1,
                                                        lease_seconds=1)) as client:
            def regions():
                return list(client._stub.ListRegions(packd.client.pb.ListRegionsRequest()).regions)

            def pack_is_exact():
                mask = torch.rand(5, 64) < 0.5
                x = random_tensor(torch.bfloat16, (5, 64, 7))
                assert same(client.pack(x, mask).packed, x[mask])
                packed = x[mask]
                assert same(client.scatter(packed, mask), reference_scatter(packed, mask, x))

            pack_is_exact()
            assert [r.lease_seconds for r in regions()] == [1]
            time.sleep(1.6)
            assert regions() == [], "the lease did not run out"
            pack_is_exact()
            assert len(regions()) == 1
            server.restart()
            pack_is_exact()
            assert len(regions()) == 1
    finally:
        assert server.stop() == 0


def test_tls_and_mutual_tls(tmp_path):
    """Certificates made now (nothing secret is checked in); health on --health_listen without
    any of them."""
    subprocess.run([os.path.join(os.path.dirname(__file__), "..", "support",
                                 "make_test_certs.sh"), str(tmp_path)], check=True,
                   stdout=subprocess.DEVNULL)
    cert = lambda name: str(tmp_path / name)
    mask = torch.rand(3, 40) < 0.5
    x = random_tensor(torch.float16, (3, 40, 6))
    with PackdServer("--tls_cert_file=" + cert("server.pem"),
                     "--tls_key_file=" + cert("server.key"),
                     "--tls_client_ca_file=" + cert("ca.pem"),
                     "--health_listen=unix:{dir}/health.sock") as address:
        with packd.Client(
                address, tls=packd.TlsOptions(ca_file=cert("ca.pem"), cert_file=cert("client.pem"),
                                              key_file=cert("client.key"),
                                              server_name="localhost")) as client:
            assert same(client.pack(x, mask).packed, x[mask])
        for kwargs in ({}, {"ca_file": cert("ca.pem")},
                       {"ca_file": cert("other-ca.pem"), "cert_file": cert("client.pem"),
                        "key_file": cert("client.key")}):
            with packd.Client(address, tls=packd.TlsOptions(server_name="localhost", **kwargs),
                              retries=0, timeout=10) as client:
                with pytest.raises(packd.PackdError) as refused:
                    client.pack(x, mask)
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE, kwargs
    with pytest.raises(ValueError):
        packd.Client(
            "unix:/nowhere", tls=packd.TlsOptions(cert_file=cert("client.pem"),
                                                  key_file=cert("client.key")))
    with pytest.raises(packd.PackdError) as unreadable:
        packd.Client("unix:/nowhere", tls=packd.TlsOptions(ca_file=cert("missing.pem")))
    assert unreadable.value.code == grpc.StatusCode.FAILED_PRECONDITION


def _step_rows(t, rows):
    return t[torch.tensor(rows, dtype=torch.long)]


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shared_memory"])
def test_pack_micro_batches_are_their_rows_packed(address, shm):
    """Every dtype, fresh data, documents, padding and shifted labels: each micro-batch is
    exactly pack() of its rows in plan order (torch's boolean pack without the layout), every
    row comes once, and the plan's loss tokens count both masks."""
    with packd.Client(
            address,
            shared_memory=packd.SharedMemoryOptions(threshold_bytes=1 if shm else 0)) as client:
        B, S = 21, 53
        mask = torch.rand(B, S) < 0.7
        segments = torch.randint(0, 3, (B, S)).cumsum(1)
        loss_mask = torch.rand(B, S) < 0.5
        xs = [random_tensor(dtype, (B, S, 2)) for dtype in DTYPES]
        tokens = torch.randint(0, 1000, (B, S))
        step = client.pack_micro_batches([tokens] + xs, mask, 96,
                                         plan=packd.PlanOptions(num_ranks=3, cost=(8, 1)),
                                         layout=packd.Layout(shifts=[(0, -100)]),
                                         loss_mask=loss_mask, segment_ids=segments,
                                         with_position_ids=True)
        assert step.plan.global_loss_tokens == int((mask & loss_mask).sum())
        seen = []
        got = list(step)
        assert [(m.rank, m.index) for m in got] == [
            (mb.rank, i % step.plan.micro_batches_per_rank)
            for i, mb in enumerate(step.plan.micro_batches)]
        for mb, planned in zip(got, step.plan.micro_batches):
            assert mb.samples == planned.samples
            seen += mb.samples
            m = _step_rows(mask, mb.samples)
            for x, packed in zip(xs, mb.result.packed[1:]):
                assert same(_step_rows(x, mb.samples)[m], packed)
            expected = client.pack([_step_rows(tokens, mb.samples)], m,
                                   segment_ids=_step_rows(segments, mb.samples),
                                   with_position_ids=True, layout=packd.Layout(shifts=[(0, -100)]))
            assert torch.equal(mb.result.packed[0], expected.packed[0])
            assert torch.equal(mb.result.shifted[0], expected.shifted[0])
            assert torch.equal(mb.result.position_ids, expected.position_ids)
            assert torch.equal(mb.result.doc_cu_seqlens, expected.doc_cu_seqlens)
            assert planned.loss_tokens == int((m & _step_rows(loss_mask, mb.samples)).sum())
        assert sorted(seen) == list(range(B))


def test_routing_tensors_pack_and_scatter_in_a_step_like_any_input(address):
    """A MoE router's choices, [B, S, layers, top_k] of uint8, int16 and int32, ride a training
    step beside the tokens: each micro-batch's are exactly the rows' active positions, and
    Scatter puts them back where they were (zeros elsewhere), as for any input."""
    with packd.Client(address,
                      shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as client:
        B, S, layers, top_k = 13, 40, 3, 2
        mask = torch.rand(B, S) < 0.6
        tokens = torch.randint(0, 1000, (B, S))
        routes = [torch.randint(0, 127, (B, S, layers, top_k)).to(dtype)
                  for dtype in (torch.uint8, torch.int16, torch.int32)]
        step = client.pack_micro_batches([tokens] + routes, mask, 64,
                                         plan=packd.PlanOptions(num_ranks=2))
        seen = []
        for mb in step:
            seen += mb.samples
            m = _step_rows(mask, mb.samples)
            for route, packed in zip(routes, mb.result.packed[1:]):
                rows = _step_rows(route, mb.samples)
                assert packed.dtype == route.dtype and torch.equal(rows[m], packed)
                dense = client.scatter(packed, m)
                assert torch.equal(dense, rows * m[:, :, None, None].to(route.dtype))
        assert sorted(seen) == list(range(B))


def test_a_steps_results_come_through_shared_memory_from_its_second_call(address):
    """Node-local with shared memory: the first step of a shape comes inline and says what its
    results take (output_bytes); the client keeps an arena of that size, so every later step of
    the shape comes through it, with the same bytes, and the arena goes back to the pool; a
    larger batch comes inline once, then through a grown arena."""
    with packd.Client(address,
                      shared_memory=packd.SharedMemoryOptions(threshold_bytes=1,
                                                              idle_segments=2)) as client:
        B, S = 32, 300
        mask = torch.rand(B, S) < 0.6
        tokens = torch.randint(0, 1000, (B, S))
        x = random_tensor(torch.bfloat16, (B, S, 3))

        def step(mask, tokens, x):
            s = client.pack_micro_batches([tokens, x], mask, 1024,
                                          plan=packd.PlanOptions(num_ranks=2),
                                          layout=packd.Layout(pad_multiple=8, shifts=[(0, -100)]),
                                          with_position_ids=True)
            return s, [(mb.samples, [t.clone() for t in mb.result.packed + mb.result.shifted])
                       for mb in s]

        first, inline = step(mask, tokens, x)
        assert first.output_bytes > 0 and first.through_shared_memory == 0
        for _ in range(2):
            again, through = step(mask, tokens, x)
            assert again.output_bytes == first.output_bytes
            assert again.through_shared_memory == len(through) == len(inline)
            for (rows_a, a), (rows_b, b) in zip(inline, through):
                assert rows_a == rows_b and all(same(p, q) for p, q in zip(a, b))
        assert len(client._regions.idle) <= 2  # the arenas went back to the pool
        # Twice the rows: inline once, then through the grown arena.
        big = [torch.cat([t, t]) for t in (mask, tokens, x)]
        grown, _ = step(*big)
        assert grown.output_bytes > first.output_bytes and grown.through_shared_memory == 0
        again, through = step(*big)
        assert again.through_shared_memory == len(through)


def test_pack_micro_batches_padding_ranks_and_errors(client):
    B, S = 12, 40
    mask = torch.rand(B, S) < 0.8
    tokens = torch.randint(0, 100, (B, S))
    step = client.pack_micro_batches(tokens, mask, 64,
                                     plan=packd.PlanOptions(num_ranks=2, micro_batch_multiple=2),
                                     layout=packd.Layout(pad_multiple=8,
                                                         fixed=(64, 0, 0)), ranks=[1])
    got = list(step)
    assert got and all(mb.rank == 1 for mb in got)
    assert len(got) == step.plan.micro_batches_per_rank
    for mb in got:
        # fixed applies to each micro-batch, empty ones included (all ghost).
        assert mb.result.packed.shape == (64,)
        planned = [p for p in step.plan.micro_batches if p.samples == mb.samples][0]
        assert planned.padded_tokens == sum(
            (int(n) + 7) // 8 * 8 for n in _step_rows(mask, mb.samples).sum(1))
    for kwargs, needle in [(dict(ranks=[2], plan=packd.PlanOptions(num_ranks=2)), "ranks[0] is 2"),
                           (dict(loss_mask=torch.ones(B, S + 1)), "loss_mask.shape"),
                           (dict(layout=packd.Layout(fixed=(16, 0, 0))), "fixed.tokens"),
                           (dict(plan=packd.PlanOptions(cost=(-1.0, 0))), "plan.cost_per_token")]:
        with pytest.raises(packd.PackdError) as e:
            list(client.pack_micro_batches(tokens, mask, 64, **kwargs))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert isinstance(e.value, ValueError)
        assert needle in e.value.details
    with pytest.raises(ValueError, match="host memory"):
        client.pack_micro_batches(tokens.to("meta"), mask, 64)
    # Closing a step early cancels the rest; the server goes on serving.
    with client.pack_micro_batches(tokens, mask, 16) as step:
        next(iter(step))
    assert len(list(client.pack_micro_batches(tokens, mask, 64))) >= 1


def test_pack_micro_batches_goes_through_the_call_mechanism(tmp_path):
    """A step is a call like Pack: it needs the token, and the memory budget refuses one that can
    never fit (RESOURCE_EXHAUSTED naming the flag) while smaller steps run; it is counted."""
    tokens = tmp_path / "tokens"
    tokens.write_text("step-token\n")
    with PackdServer("--auth_token_file=%s" % tokens,
                     "--max_inflight_bytes=4000000") as address:
        mask = torch.ones(64, 1024, dtype=torch.bool)
        x = torch.randn(64, 1024, 8)  # 2 MiB, its micro-batches more than the budget
        with packd.Client(address, token=packd.TokenOptions(file=None, env="NO_SUCH_VARIABLE"),
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as anonymous:
            with pytest.raises(packd.PackdError) as refused:
                anonymous.pack_micro_batches(x, mask, 4096)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with packd.Client(address, token=packd.TokenOptions(file=str(tokens)),
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as client:
            with pytest.raises(packd.PackdError) as refused:
                client.pack_micro_batches(x, mask, 64 * 1024)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max_inflight_bytes" in refused.value.details
            step = client.pack_micro_batches(x[:8], mask[:8], 2048)
            got = list(step)
            assert len(got) == 4
            for mb in got:
                assert torch.equal(mb.result.packed, x[mb.samples][mask[mb.samples]])
