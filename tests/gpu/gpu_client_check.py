"""packd's GPU path with real CUDA tensors, for run_gpu_checks.sh on a machine with a GPU: a packd
server (PACKD_BINARY, built with CUDA) and the Python client, checked byte for byte against torch:

  - a device region whose IPC handle another process exported (the memory of a child process,
    registered by UUID, packed by the server on the GPU);
  - Pack and Scatter of CUDA tensors of every dtype, results in the client's own GPU memory;
  - RemotePackOp forward and backward on the GPU;
  - documents (segment ids) and a layout (padding, CP, a shift) on the GPU;
  - Ulysses sequence parallelism (every SP rank's slice, and its Scatter) on the GPU;
  - shared prompts (GRPO groups: the stream, its targets and metadata, both Scatters);
  - the step (PackMicroBatches) with the batch on the GPU, against the host step and timed
    against Plan + one Pack per micro-batch on the GPU; the host batch packed on the GPU;
    shared prompts and Ulysses in the step;
  - the server's devices by UUID, as torch names them;
  - the regions' lifecycle: register_cuda_tensor (a tensor inside its allocation), a segment
    unregistered, freed and allocated again (registered again, the result right), a lease that
    runs out (NOT_FOUND, registered and opened again), a call from a new thread (no current
    context there), unregister_gpu_regions, and registrations counted against the segments
    torch holds;
  - the server's exit after SIGTERM (a row of its own).

Prints one row per check (and packd's and torch's times where both exist), then the line
"gpu client checks: N failed" whatever happened; exits 1 on any mismatch. Every check runs on its
own: an exception is that check's MISMATCH, with the exception, and the others still run.

    PACKD_BINARY=.gpu/bin/packd PYTHONPATH=.gpu/python python3 tests/gpu/gpu_client_check.py

The same checks run without a GPU against packd's fake GPU (tests/gpu/rehearse.sh):
PACKD_FAKE_GPU_LIB names libpackd_fake_gpu_c.so, whose memory this process's tensors live in, and
PACKD_BINARY a packd_testing, run with --fake_gpu_devices=1. Two switches exist for that rehearsal:
PACKD_GPU_CHECK_PLANT="ROW:byte,CHECK:raise" flips a byte of ROW's packd result before it is
compared, or raises inside CHECK (a planted failure must show as that row's MISMATCH while the
rest run), and PACKD_GPU_CHECK_QUICK=1 times each call once instead of the median of five.
"""
import gc
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

import packd
from packd import _device
from packd.v1 import pack_service_pb2 as pb

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packd_server import PackdServer, unused_port  # noqa: E402
from region_requests import region_pack_request  # noqa: E402
from torch_reference import DTYPES, reference_scatter  # noqa: E402  (any device)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_step import measure, torch_step  # noqa: E402  (the in-process peer)

failures = 0
# Device regions' lease on the region lifecycle's client: long enough that a stage's call and the
# question after it fit inside it on a loaded machine, short enough to wait out.
LEASE_SECONDS = 5
REPS = 1 if os.environ.get("PACKD_GPU_CHECK_QUICK") == "1" else 5
# Every row printed, and the targets of docs/performance.md's device table, for the JSON.
ROWS = []
TARGETS = {}
# The server's /metrics (its device counters and phase timers).
METRICS_PORT = unused_port()


def device_counts():
    """packd's device counters now: synchronisations, stream operations, bytes up."""
    import urllib.request
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % METRICS_PORT,
                                  timeout=5).read().decode()
    counts = {"syncs": 0.0, "ops": 0.0, "h2d_bytes": 0.0}
    for line in text.splitlines():
        if line.startswith("packd_device_synchronizations_total{device=\"cuda\"}"):
            counts["syncs"] += float(line.split()[-1])
        elif line.startswith("packd_device_operations_total{device=\"cuda\""):
            counts["ops"] += float(line.split()[-1])
        elif line.startswith("packd_device_copy_bytes_total{device=\"cuda\","
                             "direction=\"h2d\"}"):
            counts["h2d_bytes"] += float(line.split()[-1])
    return counts


def target(key, value, limit, at_most=True):
    """One target of the device table: its value, its limit and whether it holds."""
    TARGETS[key] = {"value": value, "limit": limit,
                    "met": value <= limit if at_most else value >= limit}


# Planted failures, for the rehearsal only: {row or check name: "byte" | "raise"}.
PLANTS = dict(p.rsplit(":", 1) for p in os.environ.get("PACKD_GPU_CHECK_PLANT", "").split(",")
              if p)


class CudaGpu:
    """torch's CUDA device 0: tensors made on the host are copied there."""
    kind = "cuda"

    def __init__(self):
        self.memory = _device.TorchCuda()

    def put(self, t):
        return t.to("cuda")

    def host(self, t):
        return t.cpu()

    def is_on(self, t):
        return t.is_cuda

    def synchronize(self):
        torch.cuda.synchronize()

    def release_freed(self):
        torch.cuda.empty_cache()  # segments nothing holds go back to the driver

    def server(self):
        return PackdServer("--device=cpu",
                           "--metrics_listen=127.0.0.1:%d" % METRICS_PORT)


class FakeGpu:
    """packd's fake GPU (tests/fake_gpu) in this process: its memory is host memory that a
    packd_testing run with --fake_gpu_devices=1 opens from IPC handles, as packd opens CUDA's."""
    kind = "fake"

    def __init__(self, library):
        from fake_gpu_memory import FakeGpuMemory
        self.memory = FakeGpuMemory(library, devices=1)

    def put(self, t):
        return self.memory.put(t.contiguous(), 0)

    def host(self, t):
        return t.clone()  # a tensor of fake device memory is already a CPU tensor

    def is_on(self, t):
        return self.memory.device_of(t) == 0

    def synchronize(self):
        pass

    def release_freed(self):
        gc.collect()  # a fake allocation is freed when its last tensor goes

    def server(self):
        return PackdServer("--fake_gpu_devices=1",
                           "--metrics_listen=127.0.0.1:%d" % METRICS_PORT)


def make_gpu():
    library = os.environ.get("PACKD_FAKE_GPU_LIB")
    return FakeGpu(library) if library else CudaGpu()


def row(check, ok, packd_ms=None, torch_ms=None, detail=""):
    global failures
    failures += 0 if ok else 1
    ROWS.append({"check": check, "ok": bool(ok), "packd_ms": packd_ms, "torch_ms": torch_ms,
                 "detail": detail})
    ms = lambda v: "%9.3f" % v if v is not None else "%9s" % "-"
    print("%-34s %-8s %s %s  %s" % (check, "ok" if ok else "MISMATCH", ms(packd_ms),
                                    ms(torch_ms), detail), flush=True)


def check(name, fn, *args):
    """Runs one check: any exception (a planted one included) becomes the row `name`'s
    MISMATCH, with the exception, and the next check runs."""
    try:
        if PLANTS.get(name) == "raise":
            raise RuntimeError("planted failure (PACKD_GPU_CHECK_PLANT)")
        fn(*args)
    except Exception as e:  # noqa: BLE001 (every failure is a row)
        traceback.print_exc(file=sys.stdout)
        row(name, False, detail="%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160]
                                            if str(e) else ""))


def timed(gpu, fn):
    """fn()'s result and its median wall time in ms (the device synchronised)."""
    out = fn()
    times = []
    for _ in range(REPS):
        gpu.synchronize()
        start = time.perf_counter()
        out = fn()
        gpu.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return out, sorted(times)[len(times) // 2]


def random_bytes(dtype, shape, gen):
    """Random bytes of `dtype` on the host (NaN payloads and -0.0 occur); bool 0 or 1."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).reshape(shape)


def same(a, b, name=None):
    """Same dtype, shape and bytes (compared on the host). With `name` planted "byte", a's first
    byte is flipped first (the rehearsal's wrong byte)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if name is not None and PLANTS.get(name) == "byte" and a.numel():
        a = a.clone()
        a[0] ^= 1
    return torch.equal(a, b)


def reference_doc_cu_seqlens(mask, ids):
    """Documents: within a row's active tokens, a new one wherever the id changes."""
    lengths = []
    for b in range(mask.shape[0]):
        a = ids[b][mask[b] != 0].cpu()
        if a.numel() == 0:
            continue
        cuts = [0] + (torch.nonzero(a[1:] != a[:-1]).flatten() + 1).tolist() + [a.numel()]
        lengths += [cuts[i + 1] - cuts[i] for i in range(len(cuts) - 1)]
    return [0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()


def child_pattern(n):
    return (torch.arange(n, dtype=torch.int64) * 2654435761 % 65521).to(torch.int32)


def export_child(n):
    """The child process (--export-child N): exports device memory it owns (N int32 of a
    pattern) and holds it until its standard input gives a line."""
    gpu = make_gpu()
    x = gpu.put(child_pattern(n))
    gpu.synchronize()
    a = gpu.memory.allocation(x)
    print(a.handle.hex(), x.data_ptr() - a.base, a.size, flush=True)
    sys.stdin.readline()


def check_child_region(gpu, client, gen):
    """A region exported by a child process, registered by UUID, packed on the GPU."""
    B, S, H = 4, 512, 32
    n = B * S * H
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--export-child",
                              str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        if len(line) != 3:
            raise RuntimeError("the child exported nothing (exit %s)" % child.poll())
        handle, offset, size = line
        uuid = gpu.memory.uuid(0)
        client._stub.RegisterDeviceRegion(pb.RegisterDeviceRegionRequest(
            name="child-region", ipc_handle=bytes.fromhex(handle), device="cuda:0",
            device_uuid=uuid, byte_size=int(size), lease_seconds=60))
        x = child_pattern(n).reshape(B, S, H)
        mask = torch.rand(B, S, generator=gen) < 0.4
        request = region_pack_request(
            "uuid:" + uuid, mask, pb.RegionSlice(region="child-region", offset=int(offset),
                                                 byte_size=n * 4), pb.DTYPE_INT32, [B, S, H])
        reply = client._stub.Pack(request)
        got = torch.frombuffer(bytearray(reply.packed[0].data), dtype=torch.int32)
        name = "region exported by a child process"
        row(name, same(got, x[mask].reshape(-1), name), detail="%d rows" % reply.total_active)
        client._stub.UnregisterRegion(pb.UnregisterRegionRequest(name="child-region"))
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=30)


def registered(client):
    """The names of the device regions the server has for this client's process."""
    return {r.name for r in client._stub.ListRegions(pb.ListRegionsRequest()).regions
            if r.kind == "device"}


def check_server_uuid(gpu, client):
    uuids = {d.uuid: d.name for d in client.info().devices if d.kind == "cuda"}
    mine = gpu.memory.uuid(0)
    row("server lists torch's GPU by UUID", mine in uuids, detail="%s = %s on the server"
        % (mine, uuids.get(mine, "?")))


def check_dtype(gpu, client, dtype, mask, gen):
    B, S, H = 8, 2048, 64
    name = str(dtype).replace("torch.", "")
    host = random_bytes(dtype, (B, S, H), gen)
    x = gpu.put(host)
    host_mask = mask.cpu()
    want = host[host_mask]
    r, packd_ms = timed(gpu, lambda: client.pack(x, mask, with_position_ids=True))
    _, torch_ms = timed(gpu, lambda: x[mask])
    ok = (same(r.packed, want, "pack " + name) and gpu.is_on(r.packed)
          and gpu.is_on(r.cu_seqlens)
          and r.cu_seqlens.tolist() == [0] + host_mask.sum(1).cumsum(0).tolist())
    row("pack " + name, ok, packd_ms, torch_ms, "%d of %d rows" % (r.total_active, B * S))
    dense, packd_ms = timed(gpu, lambda: client.scatter(r.packed, mask))
    _, torch_ms = timed(gpu, lambda: reference_scatter(x[mask], mask, x))
    row("scatter " + name, same(dense, reference_scatter(want, host_mask, host),
                                "scatter " + name) and gpu.is_on(dense), packd_ms, torch_ms)


def check_calls_against_info(gpu, client, mask, gen):
    """C1, C2: a GPU Pack and Scatter of [8, 2048, 64] float32 against a bare round trip
    (Info), and what the Pack asked of the GPU (packd's device counters)."""
    x = gpu.put(torch.randn(mask.shape + (64,), generator=gen))
    _, info_ms = timed(gpu, client.info)
    before = device_counts()
    r = client.pack(x, mask)
    after = device_counts()
    r, pack_ms = timed(gpu, lambda: client.pack(x, mask))
    _, scatter_ms = timed(gpu, lambda: client.scatter(r.packed, mask))
    target("C1 pack / info", pack_ms / info_ms, 2.0)
    target("C2 scatter / info", scatter_ms / info_ms, 1.8)
    syncs = after["syncs"] - before["syncs"]
    row("calls against Info (C1, C2)", syncs <= 1, pack_ms, info_ms,
        "pack/info %.2f (target <= 2), scatter/info %.2f (<= 1.8); the Pack waited on the "
        "GPU %d time(s), %d stream operations; torch ms column: Info"
        % (pack_ms / info_ms, scatter_ms / info_ms, syncs, after["ops"] - before["ops"]))


def check_remote_pack_op(gpu, client, mask, gen):
    op = packd.RemotePackOp(client)
    host = torch.randn(mask.shape + (64,), generator=gen)
    x = gpu.put(host).requires_grad_()
    packed, cu = op(x, mask)
    weight = torch.randn(packed.shape, generator=gen)
    (packed * gpu.put(weight)).sum().backward()
    row("RemotePackOp forward", same(packed, host[mask.cpu()], "RemotePackOp forward")
        and gpu.is_on(cu))
    row("RemotePackOp backward", same(x.grad, reference_scatter(weight, mask.cpu(), host),
                                      "RemotePackOp backward"))


def check_documents(gpu, client, x, mask, ids):
    r = client.pack(x, mask, with_position_ids=True, segment_ids=ids)
    name = "documents (segment ids)"
    row(name, same(r.packed, x.cpu()[mask.cpu()], name) and gpu.is_on(r.doc_cu_seqlens)
        and r.doc_cu_seqlens.tolist() == reference_doc_cu_seqlens(mask, ids),
        detail="%d documents" % (r.doc_cu_seqlens.numel() - 1))


def check_layout(gpu, client, x, mask, ids):
    """A layout on the GPU (padding, CP rank 1 of 2, a shift, seq_idx) against the same layout
    packed on the host by the server's CPU backend."""
    kw = dict(segment_ids=ids, with_position_ids=True, pad_multiple=8, cp_size=2,
              cp_rank=1, with_seq_idx=True, shifts=[(0, 0)], pad_values=[1])
    g = client.pack(x, mask, **kw)
    h = client.pack(gpu.host(x), gpu.host(mask), **dict(kw, segment_ids=gpu.host(ids)))
    name = "layout (pad 8, cp 2, shift)"
    row(name, same(g.packed, h.packed, name) and same(g.shifted[0], h.shifted[0])
        and g.cu_seqlens_padded.tolist() == h.cu_seqlens_padded.tolist()
        and g.seq_idx.tolist() == h.seq_idx.tolist(), detail="%d rows" % g.packed.shape[0])


def check_ulysses(gpu, client, x, mask, ids):
    """Ulysses (sp 4, every rank) on the GPU against the host: each rank's contiguous slice, the
    ghost that pads the rows to a multiple of 4, and Scatter of a rank's rows."""
    name = "ulysses (sp 4, every rank)"
    sp_ok, rows = True, 0
    for rank in range(4):
        kw = dict(segment_ids=ids, with_position_ids=True, sp_size=4, sp_rank=rank,
                  with_seq_idx=True, shifts=[(0, 0)])
        g = client.pack(x, mask, **kw)
        h = client.pack(gpu.host(x), gpu.host(mask), **dict(kw, segment_ids=gpu.host(ids)))
        back = client.scatter(g.packed, mask, segment_ids=ids,
                              layout=packd.Layout(sp_size=4, sp_rank=rank))
        back_h = client.scatter(h.packed, gpu.host(mask), segment_ids=gpu.host(ids),
                                layout=packd.Layout(sp_size=4, sp_rank=rank))
        sp_ok &= (same(g.packed, h.packed, name) and same(g.shifted[0], h.shifted[0])
                  and g.position_ids.tolist() == h.position_ids.tolist()
                  and g.cu_seqlens_padded.tolist() == h.cu_seqlens_padded.tolist()
                  and same(back, back_h))
        rows += g.packed.shape[0]
    row(name, sp_ok, detail="%d rows" % rows)


def check_shared_prompts(gpu, client, x, mask, gen):
    """Shared prompts (GRPO groups of 4, the prompt the first half of each group's shortest row)
    on the GPU against the host: the stream, its targets (a shift in target space), the
    metadata, and Scatter in stream and target mode."""
    B = mask.shape[0]
    host_mask = gpu.host(mask)
    groups = [b // 4 for b in range(B)]
    counts = host_mask.sum(1).tolist()
    prefix = [min(counts[g * 4:(g + 1) * 4]) // 2 for g in groups]
    tokens = torch.randint(0, 1000, tuple(mask.shape), generator=gen)
    active = [torch.nonzero(host_mask[b]).flatten() for b in range(B)]
    for b in range(B):  # every member's prompt its group's first row's
        f = groups[b] * 4
        tokens[b, active[b][:prefix[b]]] = tokens[f, active[f][:prefix[b]]]
    shared = packd.SharedPrefix(groups, prefix, same_inputs=(0,))
    kw = dict(with_position_ids=True, shared_prefix=shared, shifts=[(0, 0), (1, 0)])
    g, packd_ms = timed(gpu, lambda: client.pack([gpu.put(tokens), x], mask, **kw))
    h = client.pack([tokens, gpu.host(x)], host_mask, **kw)
    back = client.scatter(g.packed[1], mask, layout=packd.Layout(shared_prefix=shared))
    back_h = client.scatter(h.packed[1], host_mask, layout=packd.Layout(shared_prefix=shared))
    per_target = client.scatter(g.shifted[1], mask, layout=packd.Layout(shared_prefix=shared),
                                targets=True)
    per_target_h = client.scatter(h.shifted[1], host_mask,
                                  layout=packd.Layout(shared_prefix=shared), targets=True)
    fields = ("cu_seqlens_q", "cu_seqlens_k", "kv_index", "pred_index", "target_cu_seqlens",
              "segment_row")
    name = "shared prompts (groups of 4)"
    row(name, all(same(a, b, name) for a, b in zip(g.packed + g.shifted, h.packed + h.shifted))
        and g.position_ids.tolist() == h.position_ids.tolist()
        and all(getattr(g.shared, f).tolist() == getattr(h.shared, f).tolist() for f in fields)
        and gpu.is_on(g.shared.kv_index) and same(back, back_h)
        and same(per_target, per_target_h), packd_ms,
        detail="%d stream rows of %d tokens" % (g.total_active, sum(counts)))


def check_device_regions(client):
    ours = [n for n in client._regions.device_names() if n.startswith("py-gpu-")]
    known = {name for name, _ in client._gpu.allocations.values()}
    row("device regions registered", 0 < len(ours) and set(ours) == known,
        detail="%d regions, one per allocation known" % len(ours))


def step_results(step):
    """Every micro-batch of a StepPlan, by (rank, index)."""
    return {(mb.rank, mb.index): mb for mb in step}


def same_micro_batches(gpu, got, want, on_gpu, name=None):
    """Whether two steps' micro-batches agree: the same keys and samples, every result equal
    byte for byte (those of `got` on the device when `on_gpu`), the same cu_seqlens and position
    ids."""
    if sorted(got) != sorted(want):
        return False
    for key, mb in got.items():
        w = want[key]
        if mb.samples != w.samples:
            return False
        for a, b in zip(mb.result.packed + mb.result.shifted, w.result.packed + w.result.shifted):
            if (on_gpu and not gpu.is_on(a)) or not same(a, b, name):
                return False
        if mb.result.cu_seqlens.tolist() != w.result.cu_seqlens.tolist():
            return False
        if (mb.result.position_ids is not None
                and mb.result.position_ids.tolist() != w.result.position_ids.tolist()):
            return False
    return True


class StepBatch:
    """A rollout batch for the step checks, on the host and on the device."""

    def __init__(self, gpu, gen, B=64, S=2048):
        lengths = torch.randint(S // 8, S + 1, (B,), generator=gen)
        self.mask = torch.arange(S)[None, :] < lengths[:, None]
        self.tokens = torch.randint(0, 50000, (B, S), generator=gen)
        self.logprobs = random_bytes(torch.float32, (B, S), gen)
        self.ids = torch.randint(0, 4, (B, S), generator=gen).cumsum(1).to(torch.int32)
        self.loss_mask = self.mask & (torch.rand(B, S, generator=gen) < 0.9)
        self.d = {k: gpu.put(v) for k, v in vars(self).items()}
        self.budget = 16384


def check_step_device(gpu, client, s):
    """PackMicroBatches with the batch on the GPU (device regions: the mask and ids copied to the
    host and planned, each micro-batch gathered and packed on the GPU, its results in an arena
    there), against the same step on the host and against Plan + one Pack per micro-batch on
    the GPU (the rows gathered by torch)."""
    kw = dict(num_ranks=4, with_position_ids=True, pad_multiple=8, shifts=[(0, -100)])
    host = step_results(client.pack_micro_batches(
        [s.tokens, s.logprobs], s.mask, s.budget, segment_ids=s.ids, loss_mask=s.loss_mask,
        **kw))
    d, last = s.d, {}

    def device_step():
        step = client.pack_micro_batches([d["tokens"], d["logprobs"]], d["mask"], s.budget,
                                         segment_ids=d["ids"], loss_mask=d["loss_mask"], **kw)
        out = step_results(step)
        last["through"] = step.through_shared_memory  # results written into the GPU arena
        return out

    got, step_ms = timed(gpu, device_step)
    # What one step asks of the GPU, and how soon its first micro-batch arrives.
    before = device_counts()
    start = time.perf_counter()
    step = client.pack_micro_batches([d["tokens"], d["logprobs"]], d["mask"], s.budget,
                                     segment_ids=d["ids"], loss_mask=d["loss_mask"], **kw)
    first_ms = None
    for _ in step:
        if first_ms is None:
            gpu.synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
    gpu.synchronize()
    whole_ms = (time.perf_counter() - start) * 1e3
    spent = {k: v - before[k] for k, v in device_counts().items()}
    target("S3 first micro-batch / step", first_ms / whole_ms, 0.25)
    TARGETS["step device counts"] = spent

    def plan_and_pack():
        # Lengths as the step measures them: each document padded to 8.
        _, lengths, loss_tokens = measure(d["mask"], d["ids"], 8, d["loss_mask"])
        plan = client.plan_micro_batches(lengths, s.budget,
                                         plan=packd.PlanOptions(num_ranks=4),
                                         loss_tokens=loss_tokens)
        out = []
        for mb in plan.micro_batches:
            rows = gpu.put(torch.tensor(list(mb.samples), dtype=torch.long))
            out.append(
                client.pack([gpu.put(d["tokens"][rows]),
                             gpu.put(d["logprobs"][rows])], gpu.put(d["mask"][rows]),
                            segment_ids=gpu.put(d["ids"][rows]), with_position_ids=True,
                            layout=packd.Layout(pad_multiple=8, shifts=[(0, -100)])))
        return out

    _, pack_ms = timed(gpu, plan_and_pack)
    name = "step on the GPU (device regions)"
    row(name, same_micro_batches(gpu, got, host, True, name) and spent["syncs"] <= 4,
        step_ms, pack_ms,
        "%d micro-batches, %d into the GPU arena, %d waits on the GPU and %d stream "
        "operations a step, first micro-batch at %.0f%% of it; torch ms column: Plan + N x Pack"
        % (len(got), last["through"], spent["syncs"], spent["ops"], 100 * first_ms / whole_ms))

    def in_torch():
        def plan(lengths, loss_tokens):
            response = client.plan_micro_batches(lengths, s.budget,
                                                 plan=packd.PlanOptions(num_ranks=4),
                                                 loss_tokens=loss_tokens)
            return [(mb.rank, list(mb.samples)) for mb in response.micro_batches]
        return torch_step([d["tokens"], d["logprobs"]], d["mask"], d["ids"], pad_multiple=8,
                          shift=(0, -100), plan=plan, loss_mask=d["loss_mask"])

    peer, peer_ms = timed(gpu, in_torch)
    name = "step against a torch step (S1)"
    ok = len(peer) == len(got)
    for mb in peer:
        want = got.get((mb.rank, mb.index))
        ok = ok and want is not None and mb.samples == list(want.samples)
        if ok:
            r = want.result
            for a, b in zip(mb.packed + [mb.shifted], r.packed + r.shifted):
                ok = ok and same(a, b, name)
            ok = ok and mb.position_ids.tolist() == r.position_ids.tolist()
    target("S1 step / torch step", step_ms / peer_ms, 2.0)
    row(name, ok, step_ms, peer_ms,
        "torch ms column: the same step in this process (tests/gpu/torch_step.py); "
        "packd/torch %.2f (target <= 2)" % (step_ms / peer_ms))


def check_step_host_batch(gpu, client, s):
    kw = dict(num_ranks=4, with_position_ids=True, pad_multiple=8, shifts=[(0, -100)],
              segment_ids=s.ids, loss_mask=s.loss_mask)
    host = step_results(client.pack_micro_batches([s.tokens, s.logprobs], s.mask, s.budget,
                                                  **kw))
    staged, staged_ms = timed(gpu, lambda: step_results(client.pack_micro_batches(
        [s.tokens, s.logprobs], s.mask, s.budget, device="cuda:0", **kw)))
    name = "step, host batch packed on cuda:0"
    row(name, same_micro_batches(gpu, staged, host, False, name), staged_ms, None,
        "through shared memory when large")


def check_step_shared(gpu, client, s):
    B = s.mask.shape[0]
    groups = [b // 4 for b in range(B)]
    counts = s.mask.sum(1).tolist()
    prefix = [min(counts[g * 4:(g + 1) * 4]) // 2 for g in groups]
    shared_tokens = s.tokens.clone()
    for b in range(B):  # every member's prompt its group's first row's (prefix masks)
        shared_tokens[b, :prefix[b]] = s.tokens[groups[b] * 4, :prefix[b]]
    kw = dict(num_ranks=2, with_position_ids=True, shifts=[(0, -100)],
              shared_prefix=packd.SharedPrefix(groups, prefix, same_inputs=(0,)))
    want = step_results(client.pack_micro_batches(
        [shared_tokens, s.logprobs], s.mask, s.budget, loss_mask=s.loss_mask, **kw))
    d = s.d
    got, ms = timed(gpu, lambda: step_results(client.pack_micro_batches(
        [gpu.put(shared_tokens), d["logprobs"]], d["mask"], s.budget,
        loss_mask=d["loss_mask"], **kw)))
    name = "step, shared prompts (groups 4)"
    row(name, same_micro_batches(gpu, got, want, True, name), ms, None,
        "%d micro-batches" % len(got))


def check_step_ulysses(gpu, client, s):
    kw = dict(num_ranks=2, with_position_ids=True, sp_size=4, sp_rank=1, shifts=[(0, -100)])
    want = step_results(client.pack_micro_batches(
        [s.tokens, s.logprobs], s.mask, s.budget // 4, segment_ids=s.ids,
        loss_mask=s.loss_mask, **kw))
    d = s.d
    got, ms = timed(gpu, lambda: step_results(client.pack_micro_batches(
        [d["tokens"], d["logprobs"]], d["mask"], s.budget // 4, segment_ids=d["ids"],
        loss_mask=d["loss_mask"], **kw)))
    name = "step, ulysses (sp 4, rank 1)"
    row(name, same_micro_batches(gpu, got, want, True, name), ms, None,
        "%d micro-batches" % len(got))


class Lifecycle:
    """How regions come and go with real device memory, one row a stage, on a client of its own
    whose device regions' leases are LEASE_SECONDS. Each stage asks the server what it holds
    right after its call, before comparing results, so that a slow machine's comparison does not
    outlast the lease the call renewed."""

    def __init__(self, gpu, client, gen):
        self.gpu, self.client, self.gen = gpu, client, gen
        # Its own segment in torch's caching allocator. A fake allocation is its own whatever
        # its size, and the fake GPU's pack of 64 MiB takes seconds of the 5 s lease.
        big = 64 << 20 if gpu.kind == "cuda" else 1 << 20
        self.shape = (big // 64, 16, 1)
        self.y_host = torch.randn(self.shape, generator=gen)
        self.y = gpu.put(self.y_host)
        self.m = gpu.put(torch.ones(self.shape[0], 16, dtype=torch.bool))

    def pack_y(self):
        return self.client.pack(self.y, self.m)

    def name_of(self, t):
        return self.client._gpu.allocations[(0, self.client.device_memory.allocation(t).base)][0]

    def register_cuda_tensor(self):
        """A tensor 5 elements into its allocation, packed by its slice."""
        gpu, client = self.gpu, self.client
        whole_host = torch.randn(5 + 4 * 64 * 8, generator=self.gen)
        whole = gpu.put(whole_host)
        x, x_host = whole[5:].view(4, 64, 8), whole_host[5:].view(4, 64, 8)
        mask = torch.rand(4, 64, generator=self.gen) < 0.5
        alloc = client.device_memory.allocation(x)
        s = client.register_cuda_tensor("gpu-check-tensor", x)
        request = region_pack_request("uuid:" + gpu.memory.uuid(0), mask, s, pb.DTYPE_FLOAT32,
                                      [4, 64, 8])
        got = torch.frombuffer(bytearray(client._stub.Pack(request).packed[0].data),
                               dtype=torch.float32).view(-1, 8)
        name = "register_cuda_tensor"
        row(name, len(alloc.handle) == 64 and s.offset == x.data_ptr() - alloc.base
            and same(got, x_host[mask], name),
            detail="offset %d in an allocation of %d bytes" % (s.offset, alloc.size))
        client.unregister_region("gpu-check-tensor")

    def freed_and_allocated_again(self):
        """A segment unregistered (what to do before freeing memory packd maps), freed, and
        another allocated (perhaps at the same address): its next call registers it again and
        its result is right. Whether the address repeats is the driver's choice: a detail."""
        client = self.client
        self.pack_y()
        first = client.device_memory.allocation(self.y)
        first_name = self.name_of(self.y)
        client.unregister_gpu_regions()
        del self.y
        self.gpu.release_freed()
        self.y_host = torch.randn(self.shape, generator=self.gen)
        self.y = self.gpu.put(self.y_host)
        r = self.pack_y()
        held = registered(client)
        again = client.device_memory.allocation(self.y)
        second_name = self.name_of(self.y)
        name = "a segment freed and reallocated"
        row(name, second_name != first_name and second_name in held
            and first_name not in held and same(r.packed, self.y_host.view(-1, 1), name),
            detail="same address: %s" % (again.base == first.base))

    def unregister_gpu_regions(self):
        """None left on the server; the next call registers what it names again."""
        client = self.client
        names = set(client._regions.device_names())
        client.unregister_gpu_regions()
        none_left = not (set(client._regions.device_names()) | registered(client)) & names
        r = self.pack_y()
        held = registered(client)
        name = "unregister_gpu_regions"
        row(name, none_left and self.name_of(self.y) in held
            and same(r.packed, self.y_host.view(-1, 1), name))

    def lease_ran_out(self):
        """NOT_FOUND inside the client, registered and opened again."""
        client = self.client
        names = set(client._regions.device_names())
        start = time.monotonic()
        deadline = start + 3 * LEASE_SECONDS + 5
        while names & registered(client) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = names & registered(client)
        waited = time.monotonic() - start
        called = time.monotonic()
        r = self.pack_y()
        held = registered(client)
        took = time.monotonic() - called
        again = self.name_of(self.y) in held
        name = "a lease ran out, registered again"
        # A loaded machine may spend the whole lease inside the call (the lease starts again
        # when the call names the region, not when it ends): then the region may be gone again.
        row(name, not left and (again or took > LEASE_SECONDS)
            and same(r.packed, self.y_host.view(-1, 1), name),
            detail="expired after %.1f s%s; the call took %.2f s, its region %s" % (
                waited, " (still held: %s)" % sorted(left) if left else "", took,
                "held again" if again else "not held after it"))

    def new_thread(self):
        """A call from a new thread (no CUDA context current there until the client makes
        one)."""
        out = {}

        def call():
            try:
                out["r"] = self.pack_y()
            except Exception as e:  # noqa: BLE001 (reported as the row's detail)
                out["e"] = e

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        name = "a call from a new thread"
        row(name, "r" in out and same(out["r"].packed, self.y_host.view(-1, 1), name),
            detail=repr(out.get("e", "")))

    def registrations(self):
        """One per segment the client's calls named, never more."""
        client = self.client
        segments = {client.device_memory.allocation(t).base for t in (self.y, self.m)}
        held = registered(client)
        ours = [n for n in client._regions.device_names() if n in held]
        row("registrations = segments", len(ours) >= len(segments) and
            len(ours) == len(client._gpu.allocations),
            detail="%d regions, %d allocations known, %d input segments"
            % (len(ours), len(client._gpu.allocations), len(segments)))


def check_region_lifecycle(gpu, address, gen):
    with packd.Client(address, gpu=packd.GpuOptions(lease_seconds=LEASE_SECONDS,
                                                    device_memory=gpu.memory)) as client:
        life = Lifecycle(gpu, client, gen)
        for stage in (life.register_cuda_tensor, life.freed_and_allocated_again,
                      life.unregister_gpu_regions, life.lease_ran_out, life.new_thread,
                      life.registrations):
            check(stage.__name__.replace("_", " "), stage)


def run_checks(gpu, address):
    gen = torch.Generator().manual_seed(int(os.environ.get("SEED", "1234")))
    with packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu.memory)) as client:
        check("server lists torch's GPU by UUID", check_server_uuid, gpu, client)
        check("region exported by a child process", check_child_region, gpu, client, gen)
        B, S, H = 8, 2048, 64
        mask = gpu.put(torch.rand(B, S, generator=gen) < 0.3)
        for dtype in DTYPES:
            check("pack " + str(dtype).replace("torch.", ""), check_dtype, gpu, client, dtype,
                  mask, gen)
        check("calls against Info (C1, C2)", check_calls_against_info, gpu, client, mask,
              gen)
        check("RemotePackOp", check_remote_pack_op, gpu, client, mask, gen)
        ids = gpu.put(torch.randint(0, 3, (B, S), generator=gen).to(torch.int32))
        x = gpu.put(random_bytes(torch.bfloat16, (B, S, H), gen))
        check("documents (segment ids)", check_documents, gpu, client, x, mask, ids)
        check("layout (pad 8, cp 2, shift)", check_layout, gpu, client, x, mask, ids)
        check("ulysses (sp 4, every rank)", check_ulysses, gpu, client, x, mask, ids)
        check("shared prompts (groups of 4)", check_shared_prompts, gpu, client, x, mask, gen)
        check("device regions registered", check_device_regions, client)
        batch = StepBatch(gpu, gen)
        check("step on the GPU (device regions)", check_step_device, gpu, client, batch)
        check("step, host batch packed on cuda:0", check_step_host_batch, gpu, client, batch)
        check("step, shared prompts (groups 4)", check_step_shared, gpu, client, batch)
        check("step, ulysses (sp 4, rank 1)", check_step_ulysses, gpu, client, batch)
    check("region lifecycle", check_region_lifecycle, gpu, address, gen)


def main():
    print("%-34s %-8s %9s %9s  %s" % ("check", "result", "packd ms", "torch ms", "detail"))
    try:
        gpu = make_gpu()
        server = gpu.server()
        try:
            run_checks(gpu, server.address)
        finally:
            # The server's exit after SIGTERM: a row of its own, not an exception that hides
            # the rows above.
            code = server.stop()
            tail = " | ".join(server.log.strip().splitlines()[-3:]) if code else ""
            row("server exit after SIGTERM", code == 0, detail="exit %d %s" % (code, tail))
    except Exception as e:  # noqa: BLE001 (the device or the server did not come up)
        traceback.print_exc(file=sys.stdout)
        row("setup (device, server)", False, detail="%s: %s" % (type(e).__name__, e))
    finally:
        for key, t in sorted(TARGETS.items()):
            if "met" in t:
                print("target %-30s %8.3f (limit %s) %s" % (
                    key, t["value"], t["limit"], "met" if t["met"] else "MISSED"))
            else:
                print("target %-30s %s" % (key, t))
        if os.environ.get("PACKD_GPU_CHECK_JSON"):
            import json
            with open(os.environ["PACKD_GPU_CHECK_JSON"], "w") as f:
                json.dump({"rows": ROWS, "targets": TARGETS, "device": getattr(
                    torch.cuda, "get_device_name", lambda: "")() if torch.cuda.is_available()
                    else "fake GPU"}, f, indent=1)
        print("gpu client checks: %d failed" % failures, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export-child"]:
        export_child(int(sys.argv[2]))
    else:
        sys.exit(main())
