"""One packd.Client shared by many threads (clients are safe to share, as gRPC stubs are), and
the safety of its retries: a register call whose reply was lost, and attempts bounded by one
deadline."""
import glob
import os
import random
import threading
import time

import grpc
import pytest
import torch

import packd
from packd_server import unused_port
from torch_reference import (DTYPES, bits, gathered, random_tensor, reference_layout,
                             reference_scatter, reference_shared, same)

SPLIT_BYTES = 24 << 10  # the client's split_threshold_bytes below
SHM_BYTES = 64 << 10    # and its shm_threshold_bytes
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _regions(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        return [r.name for r in c._stub.ListRegions(packd.client.pb.ListRegionsRequest()).regions]


def _linked():
    """This process's segment names still in /dev/shm."""
    return glob.glob("/dev/shm/*_py_%d_*" % os.getpid())


def _in_threads(work, count):
    """Runs work(0) .. work(count - 1) on threads of their own, at once, and waits for them."""
    threads = [threading.Thread(target=work, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _case(rng, nbytes, dtypes):
    dtype = rng.choice(dtypes)
    b, s = rng.randint(3, 8), rng.randint(8, 31)
    itemsize = torch.empty((), dtype=dtype).element_size()
    tail = max(1, nbytes // (b * s * itemsize))
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    x = random_tensor(dtype, (b, s, tail), gen)
    mask = torch.rand(b, s, generator=gen) < rng.uniform(0.2, 0.8)
    if rng.random() < 0.5:
        mask = mask.to(torch.int32) * rng.choice([1, 2, -3])
    return x, mask


def test_threads_sharing_one_client_each_get_their_own_results(address):
    """8 threads share one client and mix every path (inline, split into parts over 3
    connections, shared-memory scratch) with pack, scatter, a differentiable pack, a layout
    pack, a shared prefix's stream and targets, a plan by cost, a step and a streaming step
    (opened, submitted to and received on the one client); every result equals torch's, byte
    for byte. Before each call had its own scratch segment, most
    such calls returned another thread's rows or were refused."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    taken = {"inline": 0, "split": 0, "shm": 0}
    failures = []
    lock = threading.Lock()
    client = packd.Client(
        address, connection=packd.ConnectionOptions(split_threshold_bytes=SPLIT_BYTES,
                                                    connections=3),
        shared_memory=packd.SharedMemoryOptions(threshold_bytes=SHM_BYTES, idle_segments=2))
    op = packd.RemotePackOp(client)
    # Plans by cost with groups and padding, made once up front: every thread's
    # plan of the same request is the same (plans are deterministic).
    plan_rng = random.Random(seed)
    plans = []
    for _ in range(3):
        lengths = [plan_rng.randint(1, 5000) for _ in range(200)]
        kwargs = dict(plan=packd.PlanOptions(num_ranks=plan_rng.randint(1, 8), cost=(24576, 1),
                                             groups=[i // 2 for i in range(200)],
                                             pipeline_order=True),
                      pad_multiple=16)
        plans.append((lengths, kwargs, client.plan_micro_batches(lengths, 16384, **kwargs)))

    def work(t):
        rng = random.Random(seed + t)
        for i in range(16):
            path = rng.choice(["inline", "split", "shm"])
            nbytes = {"inline": 4 << 10, "split": 14 << 10,
                      "shm": (40 << 10) + rng.randrange(400 << 10)}[path]
            kind = rng.choice(["pack", "scatter", "grad", "layout", "shared", "plan", "step",
                               "streaming"])
            x, mask = _case(rng, nbytes, FLOATS if kind == "grad" else DTYPES)
            active = mask != 0
            total = 2 * x.numel() * x.element_size() + mask.numel() * mask.element_size()
            got = "shm" if total >= SHM_BYTES else "split" if total >= SPLIT_BYTES else "inline"
            where = "thread %d call %d: %s %s %s" % (t, i, kind, got, tuple(x.shape))
            try:
                if kind == "pack":
                    r = client.pack(x, mask, with_position_ids=True)
                    assert same(bits(x)[active].view(x.dtype), r.packed), where
                    counts = active.sum(1)
                    assert r.cu_seqlens.tolist() == [0] + counts.cumsum(0).tolist(), where
                    assert r.position_ids.tolist() == (
                        active.long().cumsum(1) - 1)[active].tolist(), where
                elif kind == "layout":  # padding, a CP or SP rank, a shift: whole, inline
                    rank = rng.randrange(2)
                    if rng.random() < 0.5:
                        r = client.pack(
                            x, mask, layout=packd.Layout(pad_multiple=4, cp_size=2, cp_rank=rank,
                                                         shifts=[(0, 0)]))
                        rows, shifted, *_ = reference_layout(mask, None, 4, 2, rank)
                    else:
                        r = client.pack(
                            x, mask, layout=packd.Layout(sp_size=2, sp_rank=rank, shifts=[(0, 0)]))
                        rows, shifted, *_ = reference_layout(mask, None, sp=2, sp_rank=rank)
                    assert same(gathered(x, rows, 0), r.packed), where
                    assert same(gathered(x, shifted, 0), r.shifted[0]), where
                elif kind == "shared":  # GRPO groups: the stream, its targets and back
                    B = x.shape[0]
                    groups = [rng.randrange(1 + B // 2) for _ in range(B)]
                    counts = active.sum(1).tolist()
                    shortest = {g: min(c for h, c in zip(groups, counts) if h == g)
                                for g in groups}
                    prompt = {g: rng.randint(0, n) for g, n in shortest.items()}
                    prefix = [prompt[g] for g in groups]
                    shared = packd.SharedPrefix(groups, prefix)
                    r = client.pack(x, mask, layout=packd.Layout(shared_prefix=shared,
                                                                 shifts=[(0, 0)]))
                    rows, targets = reference_shared(active, groups, prefix)
                    flat = [t for row in targets for t in row]
                    assert same(gathered(x, rows, 0), r.packed), where
                    assert same(gathered(x, flat, 0), r.shifted[0]), where
                    dense = client.scatter(r.shifted[0], mask,
                                           layout=packd.Layout(shared_prefix=shared), targets=True)
                    want = torch.zeros_like(bits(x)).reshape(-1, *x.shape[2:])
                    want[flat] = bits(x).reshape(-1, *x.shape[2:])[flat]
                    assert same(want.view(x.dtype).reshape(x.shape), dense), where
                elif kind == "step":  # a streamed step: each micro-batch is its rows packed
                    step = client.pack_micro_batches(
                        x, mask, rng.randint(8, 64),
                        plan=packd.PlanOptions(num_ranks=rng.randint(1, 3)))
                    rows_seen = []
                    for mb in step:
                        rows = torch.tensor(mb.samples, dtype=torch.long)
                        assert same(bits(x)[rows][active[rows]].view(x.dtype),
                                    mb.result.packed), where
                        rows_seen += mb.samples
                    assert sorted(rows_seen) == list(range(x.shape[0])), where
                elif kind == "streaming":  # open, submit and receive on the one client
                    with client.open_step(rng.randint(8, 64)) as opened:
                        stream = client.receive_step(opened.step_id, 0)
                        received = []
                        reader = threading.Thread(target=received.extend, args=(stream,))
                        reader.start()
                        half = x.shape[0] // 2
                        row_of = {}
                        for a, b in ((0, half), (half, x.shape[0])):
                            first = client.submit_group(opened.step_id, x[a:b], mask[a:b]).first_row
                            row_of.update({first + k: a + k for k in range(b - a)})
                        opened.close()
                        reader.join(30)
                    rows_seen = []
                    for mb in received:
                        rows = torch.tensor([row_of[s] for s in mb.samples], dtype=torch.long)
                        assert same(bits(x)[rows][active[rows]].view(x.dtype),
                                    mb.result.packed[0]), where
                        rows_seen += rows.tolist()
                    assert sorted(rows_seen) == list(range(x.shape[0])), where
                elif kind == "plan":
                    lengths, kwargs, want = rng.choice(plans)
                    assert client.plan_micro_batches(lengths, 16384, **kwargs) == want, where
                elif kind == "scatter":
                    packed = bits(x)[active].view(x.dtype)
                    dense = client.scatter(packed, mask)
                    assert same(reference_scatter(packed, mask, x), dense), where
                else:
                    xg = x.clone().requires_grad_(True)
                    packed, _ = op(xg, mask)
                    assert same(bits(x)[active].view(x.dtype), packed.detach()), where
                    g = random_tensor(x.dtype, tuple(packed.shape))
                    packed.backward(g)
                    assert same(reference_scatter(g, mask, x), xg.grad), where
                with lock:
                    taken[got] += 1
            except Exception as e:  # collected: an assert in a thread fails nothing by itself
                with lock:
                    failures.append("%s: %r" % (where, e))

    _in_threads(work, 8)
    assert not failures, "\n".join(failures[:10])
    assert all(n > 0 for n in taken.values()), taken
    assert len([r for r in _regions(address) if r.startswith("py-")]) <= 2  # idle ones
    client.close()
    assert [r for r in _regions(address) if r.startswith("py-")] == []
    assert _linked() == []


def test_the_drop_ins_share_their_default_client_across_threads(address, monkeypatch):
    """8 threads call packd.flash_attn and packd.hf with no client given, from a fresh start:
    they make one default client between them (of $PACKD_ADDRESS), and each gets its own
    results, equal to torch's, gradients included."""
    from packd import _default, flash_attn
    from packd.hf import DataCollatorWithFlattening
    flash_attn.set_client(None)
    monkeypatch.setenv("PACKD_ADDRESS", address)
    seed = random.randrange(1 << 30)
    print("seed", seed)
    failures, clients = [], []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def work(t):
        rng = random.Random(seed + t)
        gen = torch.Generator().manual_seed(seed + t)
        start.wait()  # all at once, so that the first calls race to make the client
        for i in range(6):
            where = "thread %d call %d" % (t, i)
            try:
                B, S = rng.randint(1, 6), rng.randint(1, 40)
                mask = torch.rand(B, S, generator=gen) < 0.6
                mask[0, 0] = True
                x = torch.randn(B, S, 3, dtype=torch.float64, generator=gen,
                                requires_grad=True)
                packed, indices, cu, longest, used = flash_attn.unpad_input(x, mask)
                assert torch.equal(packed.detach(), x.detach()[mask]), where
                assert torch.equal(indices, torch.nonzero(mask.flatten()).flatten()), where
                lengths = mask.sum(1, dtype=torch.int32)
                assert cu.tolist() == [0] + lengths.cumsum(0).tolist(), where
                assert longest == int(lengths.max()) and torch.equal(used, lengths), where
                dense = flash_attn.pad_input(packed * 2, indices, B, S)
                assert torch.equal(dense.detach(), torch.where(
                    mask[..., None], x.detach() * 2, torch.zeros(()))), where
                dense.sum().backward()
                assert torch.equal(x.grad, (mask[..., None] * 2.0).to(x.dtype).expand_as(x)), \
                    where
                features = [{"input_ids": [rng.randrange(1000) for _ in range(rng.randint(1, 9))]}
                            for _ in range(rng.randint(1, 5))]
                batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
                ids = [v for f in features for v in f["input_ids"]]
                assert batch["input_ids"].tolist() == [ids], where
                assert batch["labels"].tolist() == [[v for f in features for v in
                                                     [-100] + f["input_ids"][1:]]], where
                assert batch["position_ids"].tolist() == [[p for f in features for p in
                                                           range(len(f["input_ids"]))]], where
                with lock:
                    clients.append(_default.resolve(None))
            except Exception as e:  # collected: an assert in a thread fails nothing by itself
                with lock:
                    failures.append("%s: %r" % (where, e))

    _in_threads(work, 8)
    default = _default.resolve(None)
    flash_attn.set_client(None)
    default.close()
    assert not failures, "\n".join(failures[:10])
    assert len(clients) == 48 and all(c is default for c in clients)


class _LostReply(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the test dropped this reply"


class _DropReplies(grpc.UnaryUnaryClientInterceptor):
    """Turns the first `left` successful replies of `method` into UNAVAILABLE: the server
    acted, the client never heard."""

    def __init__(self, method, left):
        self.method, self.left = method, left

    def intercept_unary_unary(self, continuation, details, request):
        call = continuation(details, request)
        if details.method.endswith(self.method) and call.code() == grpc.StatusCode.OK \
                and self.left > 0:
            self.left -= 1
            raise _LostReply()
        return call


def test_a_register_call_repeated_after_a_lost_reply_succeeds(address):
    """The server finds the region the first attempt registered and says OK (it said
    ALREADY_EXISTS, and the segment's name was left in /dev/shm); the call goes through it."""
    drop = _DropReplies("/RegisterSystemRegion", 1)
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=1),
                      interceptors=[drop]) as client:
        mask = torch.rand(4, 64) < 0.5
        x = random_tensor(torch.float32, (4, 64, 16))
        r = client.pack(x, mask)
        assert drop.left == 0, "no reply was dropped"
        assert same(bits(x)[mask].view(x.dtype), r.packed)
        assert client._regions.idle and all(s.region in _regions(address) for s in client._regions.idle)
        assert _linked() == []
    assert [r for r in _regions(address) if r.startswith("py-")] == []


def test_all_attempts_of_a_call_end_within_its_deadline():
    """Against an address where nothing listens, 1000 attempts with backoff take minutes; the
    call's one deadline ends them."""
    with packd.Client("127.0.0.1:%d" % unused_port(), timeout=1.0, retries=1000) as c:
        start = time.monotonic()
        with pytest.raises(packd.PackdError) as err:
            c.info()
        took = time.monotonic() - start
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert took < 20, took  # generous for a loaded machine; unbounded it is minutes


def test_close_closes_every_connection(address):
    client = packd.Client(address, connection=packd.ConnectionOptions(connections=3),
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    assert client.info().version
    client.close()
    for channel in client._connection.channels:
        with pytest.raises(ValueError):  # grpcio: "Cannot invoke RPC on closed channel!"
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"")
