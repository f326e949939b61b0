"""packd's GPU path with real CUDA tensors, for run_gpu_checks.sh on a machine with a GPU: a packd
server (PACKD_BINARY, built with CUDA) and the Python client, checked byte for byte against torch
on the GPU:

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
    freed and another allocated at the same address (a new handle, a new registration), a
    lease that runs out (NOT_FOUND, registered and opened again), a call from a new thread
    (no current context there), unregister_gpu_regions, and registrations counted against the
    segments torch holds.

Prints one row per check (and packd's and torch's times where both exist); exits 1 on any
mismatch.

    PACKD_BINARY=.gpu/bin/packd PYTHONPATH=.gpu/python python3 tests/gpu/gpu_client_check.py
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

import packd
from packd import _device
from packd.v1 import pack_service_pb2 as pb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
from packd_server import PackdServer  # noqa: E402
from torch_reference import DTYPES, reference_scatter  # noqa: E402  (any device)

failures = 0


def row(check, ok, packd_ms=None, torch_ms=None, detail=""):
    global failures
    failures += 0 if ok else 1
    ms = lambda v: "%9.3f" % v if v is not None else "%9s" % "-"
    print("%-34s %-8s %s %s  %s" % (check, "ok" if ok else "MISMATCH", ms(packd_ms),
                                    ms(torch_ms), detail), flush=True)


def timed(fn, reps=5):
    """fn()'s result and its median wall time in ms (the GPU synchronised)."""
    out = fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return out, sorted(times)[len(times) // 2]


def random_bytes(dtype, shape, gen):
    """Random bytes of `dtype` on the GPU (NaN payloads and -0.0 occur); bool 0 or 1."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device="cuda") < 0.5
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for d in shape:
        n *= d
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen, device="cuda")
    return data.view(dtype).reshape(shape)


def same(a, b):
    """Same dtype, shape and bytes (on the GPU)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


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


# The child process: exports device memory it owns and holds it until told to let go.
CHILD = r"""
import sys, torch
from packd import _device
n = int(sys.argv[1])
x = (torch.arange(n, device="cuda", dtype=torch.int64) * 2654435761 % 65521).to(torch.int32)
torch.cuda.synchronize()
a = _device.TorchCuda().allocation(x)
print(a.handle.hex(), x.data_ptr() - a.base, a.size, flush=True)
sys.stdin.readline()
"""


def check_child_region(client, gen):
    """A region exported by a child process, registered by UUID, packed on the GPU."""
    B, S, H = 4, 512, 32
    n = B * S * H
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        handle, offset, size = child.stdout.readline().split()
        uuid = _device.TorchCuda().uuid(0)
        client._stub.RegisterDeviceRegion(pb.RegisterDeviceRegionRequest(
            name="child-region", ipc_handle=bytes.fromhex(handle), device="cuda:0",
            device_uuid=uuid, byte_size=int(size), lease_seconds=60))
        x = (torch.arange(n, device="cuda", dtype=torch.int64) * 2654435761 % 65521).to(
            torch.int32).reshape(B, S, H)
        mask = torch.rand(B, S, generator=gen, device="cuda") < 0.4
        request = pb.PackRequest(device="uuid:" + uuid)
        request.mask.dtype = pb.DTYPE_BOOL
        request.mask.shape.extend([B, S])
        request.mask.data = mask.cpu().numpy().tobytes()
        t = request.inputs.add()
        t.dtype = pb.DTYPE_INT32
        t.shape.extend([B, S, H])
        t.region.region, t.region.offset, t.region.byte_size = "child-region", int(offset), n * 4
        reply = client._stub.Pack(request)
        got = torch.frombuffer(bytearray(reply.packed[0].data), dtype=torch.int32)
        want = x[mask].cpu().reshape(-1)
        row("region exported by a child process", torch.equal(got, want),
            detail="%d rows" % reply.total_active)
        client._stub.UnregisterRegion(pb.UnregisterRegionRequest(name="child-region"))
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=30)


def registered(client):
    """The names of the device regions the server has for this client's process."""
    return {r.name for r in client._stub.ListRegions(pb.ListRegionsRequest()).regions
            if r.kind == "device"}


def check_region_lifecycle(address, gen):
    """How regions come and go with real CUDA memory (each a row)."""
    with packd.Client(address, gpu_lease_seconds=2) as client:
        # register_cuda_tensor: a tensor 5 elements into its allocation, packed by its slice.
        whole = torch.randn(5 + 4 * 64 * 8, generator=gen, device="cuda")
        x = whole[5:].view(4, 64, 8)
        mask = torch.rand(4, 64, generator=gen, device="cuda") < 0.5
        alloc = client.device_memory.allocation(x)
        s = client.register_cuda_tensor("gpu-check-tensor", x)
        request = pb.PackRequest(device="uuid:" + client._gpu.uuid(0))
        request.mask.dtype = pb.DTYPE_BOOL
        request.mask.shape.extend([4, 64])
        request.mask.data = mask.cpu().numpy().tobytes()
        t = request.inputs.add()
        t.dtype = pb.DTYPE_FLOAT32
        t.shape.extend([4, 64, 8])
        t.region.CopyFrom(s)
        got = torch.frombuffer(bytearray(client._stub.Pack(request).packed[0].data),
                               dtype=torch.float32).view(-1, 8)
        row("register_cuda_tensor", len(alloc.handle) == 64 and s.offset == x.data_ptr() -
            alloc.base and torch.equal(got, x[mask].cpu()),
            detail="offset %d in an allocation of %d bytes" % (s.offset, alloc.size))
        client.unregister_region("gpu-check-tensor")

        # A segment freed and another allocated at its address: a new handle, a new region.
        big = 64 << 20  # its own segment in torch's caching allocator
        y = torch.randn(big // 4, generator=gen, device="cuda").view(-1, 16, 1)
        m = torch.ones(y.shape[0], 16, dtype=torch.bool, device="cuda")
        client.pack(y, m)
        first = client.device_memory.allocation(y)
        first_name = client._gpu.allocations[(0, first.base)][0]
        del y
        torch.cuda.empty_cache()  # the segment goes back to the driver, still registered
        y = torch.randn(big // 4, generator=gen, device="cuda").view(-1, 16, 1)
        again = client.device_memory.allocation(y)
        r = client.pack(y, m)
        second_name = client._gpu.allocations[(0, again.base)][0]
        row("a segment freed and reallocated", same(r.packed, y[m]) and
            second_name != first_name and first_name not in registered(client),
            detail="same address: %s, new handle: %s" % (again.base == first.base,
                                                         again.handle != first.handle))

        # unregister_gpu_regions (what to call before empty_cache): none left on the server;
        # the next call registers what it names again.
        client.unregister_gpu_regions()
        none_left = not (set(client._regions.device_names()) | registered(client)) & {
            first_name, second_name}
        r = client.pack(y, m)
        row("unregister_gpu_regions", none_left and same(r.packed, y[m]))

        # A lease that runs out: NOT_FOUND inside the client, registered and opened again.
        names = set(client._regions.device_names())
        deadline = time.time() + 15
        while names & registered(client) and time.time() < deadline:
            time.sleep(0.2)
        expired = not (names & registered(client))
        r = client.pack(y, m)
        row("a lease ran out, registered again", expired and same(r.packed, y[m]) and
            client._gpu.allocations[(0, again.base)][0] in registered(client))

        # A call from a new thread (no CUDA context current there until the client makes one).
        out = {}
        def call():
            try:
                out["r"] = client.pack(y, m)
            except Exception as e:  # reported as the row's detail
                out["e"] = e
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        row("a call from a new thread", "r" in out and same(out["r"].packed, y[m]),
            detail=repr(out.get("e", "")))

        # Registrations: one per segment the client's calls named, never more.
        segments = {client.device_memory.allocation(t).base for t in (y, m)}
        ours = [n for n in client._regions.device_names() if n in registered(client)]
        row("registrations = segments", len(ours) >= len(segments) and
            len(ours) == len(client._gpu.allocations),
            detail="%d regions, %d allocations known, %d input segments"
            % (len(ours), len(client._gpu.allocations), len(segments)))


def step_results(step):
    """Every micro-batch of a StepPlan, by (rank, index)."""
    return {(mb.rank, mb.index): mb for mb in step}


def same_micro_batches(got, want, on_gpu):
    """Whether two steps' micro-batches agree: the same keys and samples, every result equal
    byte for byte (those of `got` on the GPU when `on_gpu`), the same cu_seqlens and position
    ids."""
    if sorted(got) != sorted(want):
        return False
    for key, mb in got.items():
        w = want[key]
        if mb.samples != w.samples:
            return False
        for a, b in zip(mb.result.packed + mb.result.shifted, w.result.packed + w.result.shifted):
            if (on_gpu and not a.is_cuda) or not same(a.cpu(), b.cpu()):
                return False
        if mb.result.cu_seqlens.tolist() != w.result.cu_seqlens.tolist():
            return False
        if (mb.result.position_ids is not None
                and mb.result.position_ids.tolist() != w.result.position_ids.tolist()):
            return False
    return True


def check_step(client, gen):
    """PackMicroBatches with the batch on the GPU (device regions: the mask and ids copied to
    the host and planned, each micro-batch gathered and packed on the GPU, its results in an
    arena there), against the same step on the host and against Plan + one Pack per
    micro-batch on the GPU (the rows gathered by torch); then the host batch through shared
    memory packed on the GPU, shared prompts and Ulysses."""
    B, S = 64, 2048
    lengths = torch.randint(S // 8, S + 1, (B,), generator=gen, device="cuda")
    mask = torch.arange(S, device="cuda")[None, :] < lengths[:, None]
    tokens = torch.randint(0, 50000, (B, S), generator=gen, device="cuda")
    logprobs = random_bytes(torch.float32, (B, S), gen)
    ids = torch.randint(0, 4, (B, S), generator=gen, device="cuda").cumsum(1).to(torch.int32)
    loss_mask = mask & (torch.rand(B, S, generator=gen, device="cuda") < 0.9)
    budget = 16384
    kw = dict(num_ranks=4, segment_ids=ids, loss_mask=loss_mask, with_position_ids=True,
              pad_multiple=8, shifts=[(0, -100)])
    host = step_results(client.pack_micro_batches(
        [tokens.cpu(), logprobs.cpu()], mask.cpu(), budget,
        **dict(kw, segment_ids=ids.cpu(), loss_mask=loss_mask.cpu())))
    last = {}

    def device_step():
        step = client.pack_micro_batches([tokens, logprobs], mask, budget, **kw)
        out = step_results(step)
        last["through"] = step.through_shared_memory  # results written into the GPU arena
        return out

    got, step_ms = timed(device_step)
    through = last["through"]

    def plan_and_pack():
        counts = (mask.sum(1) + 7) // 8 * 8  # lengths as the step measures them: padded docs
        plan = client.plan_micro_batches([int(v) for v in counts.tolist()], budget,
                                         num_ranks=4)
        out = []
        for mb in plan.micro_batches:
            rows = torch.tensor(list(mb.samples), device="cuda", dtype=torch.long)
            out.append(client.pack(
                [tokens[rows], logprobs[rows]], mask[rows], segment_ids=ids[rows],
                with_position_ids=True, pad_multiple=8, shifts=[(0, -100)]))
        return out

    _, pack_ms = timed(plan_and_pack)
    row("step on the GPU (device regions)", same_micro_batches(got, host, True), step_ms,
        pack_ms, "%d micro-batches, %d into the GPU arena; torch ms column: Plan + N x Pack"
        % (len(got), through))

    host_batch = [tokens.cpu(), logprobs.cpu()]
    hkw = dict(kw, segment_ids=ids.cpu(), loss_mask=loss_mask.cpu(), device="cuda:0")
    staged, staged_ms = timed(lambda: step_results(
        client.pack_micro_batches(host_batch, mask.cpu(), budget, **hkw)))
    row("step, host batch packed on cuda:0", same_micro_batches(staged, host, False),
        staged_ms, None, "through shared memory when large")

    groups = [b // 4 for b in range(B)]
    counts = mask.sum(1).tolist()
    prefix = [min(counts[g * 4:(g + 1) * 4]) // 2 for g in groups]
    shared_tokens = tokens.clone()
    for b in range(B):  # every member's prompt its group's first row's (prefix masks)
        shared_tokens[b, :prefix[b]] = tokens[groups[b] * 4, :prefix[b]]
    skw = dict(num_ranks=2, loss_mask=loss_mask, with_position_ids=True,
               shared_prefix=packd.SharedPrefix(groups, prefix, same_inputs=(0,)),
               shifts=[(0, -100)])
    want = step_results(client.pack_micro_batches(
        [shared_tokens.cpu(), logprobs.cpu()], mask.cpu(), budget,
        **dict(skw, loss_mask=loss_mask.cpu())))
    got, ms = timed(lambda: step_results(client.pack_micro_batches(
        [shared_tokens, logprobs], mask, budget, **skw)))
    row("step, shared prompts (groups 4)", same_micro_batches(got, want, True), ms, None,
        "%d micro-batches" % len(got))

    ukw = dict(num_ranks=2, segment_ids=ids, loss_mask=loss_mask, with_position_ids=True,
               sp_size=4, sp_rank=1, shifts=[(0, -100)])
    want = step_results(client.pack_micro_batches(
        [tokens.cpu(), logprobs.cpu()], mask.cpu(), budget // 4,
        **dict(ukw, segment_ids=ids.cpu(), loss_mask=loss_mask.cpu())))
    got, ms = timed(lambda: step_results(client.pack_micro_batches(
        [tokens, logprobs], mask, budget // 4, **ukw)))
    row("step, ulysses (sp 4, rank 1)", same_micro_batches(got, want, True), ms, None,
        "%d micro-batches" % len(got))


def main():
    gen = torch.Generator(device="cuda").manual_seed(int(os.environ.get("SEED", "1234")))
    print("%-34s %-8s %9s %9s  %s" % ("check", "result", "packd ms", "torch ms", "detail"))
    with PackdServer(os.environ["PACKD_BINARY"], "--device=cpu") as address, \
            packd.Client(address) as client:
        uuids = {d.uuid: d.name for d in client.info().devices if d.kind == "cuda"}
        mine = _device.TorchCuda().uuid(0)
        row("server lists torch's GPU by UUID", mine in uuids, detail="%s = %s on the server"
            % (mine, uuids.get(mine, "?")))
        check_child_region(client, gen)

        B, S, H = 8, 2048, 64
        mask = torch.rand(B, S, generator=gen, device="cuda") < 0.3
        for dtype in DTYPES:
            name = str(dtype).replace("torch.", "")
            x = random_bytes(dtype, (B, S, H), gen)
            r, packd_ms = timed(lambda: client.pack(x, mask, with_position_ids=True))
            _, torch_ms = timed(lambda: x[mask])
            ok = (same(r.packed, x[mask]) and r.cu_seqlens.is_cuda
                  and r.cu_seqlens.tolist() == [0] + mask.sum(1).cumsum(0).tolist())
            row("pack " + name, ok, packd_ms, torch_ms, "%d of %d rows" % (r.total_active, B * S))
            dense, packd_ms = timed(lambda: client.scatter(r.packed, mask))
            want, torch_ms = timed(lambda: reference_scatter(x[mask], mask, x))
            row("scatter " + name, same(dense, want), packd_ms, torch_ms)

        op = packd.RemotePackOp(client)
        x = torch.randn(B, S, H, generator=gen, device="cuda", requires_grad=True)
        packed, cu = op(x, mask)
        weight = torch.randn(packed.shape, generator=gen, device="cuda")
        (packed * weight).sum().backward()
        row("RemotePackOp forward", same(packed.detach(), x.detach()[mask]) and cu.is_cuda)
        row("RemotePackOp backward", same(x.grad, reference_scatter(weight, mask, x.detach())))

        ids = torch.randint(0, 3, (B, S), generator=gen, device="cuda").to(torch.int32)
        x = random_bytes(torch.bfloat16, (B, S, H), gen)
        r = client.pack(x, mask, with_position_ids=True, segment_ids=ids)
        row("documents (segment ids)", same(r.packed, x[mask]) and r.doc_cu_seqlens.is_cuda
            and r.doc_cu_seqlens.tolist() == reference_doc_cu_seqlens(mask, ids),
            detail="%d documents" % (r.doc_cu_seqlens.numel() - 1))
        # A layout on the GPU (padding, CP rank 1 of 2, a shift, seq_idx) against the same
        # layout packed on the host by the server's CPU backend.
        kw = dict(segment_ids=ids, with_position_ids=True, pad_multiple=8, cp_size=2,
                  cp_rank=1, with_seq_idx=True, shifts=[(0, 0)], pad_values=[1])
        g = client.pack(x, mask, **kw)
        h = client.pack(x.cpu(), mask.cpu(), **dict(kw, segment_ids=ids.cpu()))
        row("layout (pad 8, cp 2, shift)", same(g.packed.cpu(), h.packed)
            and same(g.shifted[0].cpu(), h.shifted[0])
            and g.cu_seqlens_padded.tolist() == h.cu_seqlens_padded.tolist()
            and g.seq_idx.tolist() == h.seq_idx.tolist(),
            detail="%d rows" % g.packed.shape[0])
        # Ulysses (sp 4, every rank) on the GPU against the host: each rank's contiguous
        # slice, the ghost that pads the rows to a multiple of 4, and Scatter of a rank's rows.
        sp_ok, rows = True, 0
        for rank in range(4):
            kw = dict(segment_ids=ids, with_position_ids=True, sp_size=4, sp_rank=rank,
                      with_seq_idx=True, shifts=[(0, 0)])
            g = client.pack(x, mask, **kw)
            h = client.pack(x.cpu(), mask.cpu(), **dict(kw, segment_ids=ids.cpu()))
            back = client.scatter(g.packed, mask, segment_ids=ids, sp_size=4, sp_rank=rank)
            back_h = client.scatter(h.packed, mask.cpu(), segment_ids=ids.cpu(), sp_size=4,
                                    sp_rank=rank)
            sp_ok &= (same(g.packed.cpu(), h.packed) and same(g.shifted[0].cpu(), h.shifted[0])
                      and g.position_ids.tolist() == h.position_ids.tolist()
                      and g.cu_seqlens_padded.tolist() == h.cu_seqlens_padded.tolist()
                      and same(back.cpu(), back_h))
            rows += g.packed.shape[0]
        row("ulysses (sp 4, every rank)", sp_ok, detail="%d rows" % rows)
        # Shared prompts (GRPO groups of 4, the prompt the first half of each group's
        # shortest row) on the GPU against the host: the stream, its targets (a shift in
        # target space), the metadata, and Scatter in stream and target mode.
        groups = [b // 4 for b in range(B)]
        counts = mask.sum(1).tolist()
        prefix = [min(counts[g * 4:(g + 1) * 4]) // 2 for g in groups]
        tokens = torch.randint(0, 1000, (B, S), generator=gen, device="cuda")
        active = [torch.nonzero(mask[b]).flatten() for b in range(B)]
        for b in range(B):  # every member's prompt its group's first row's
            f = groups[b] * 4
            tokens[b, active[b][:prefix[b]]] = tokens[f, active[f][:prefix[b]]]
        shared = packd.SharedPrefix(groups, prefix, same_inputs=(0,))
        kw = dict(with_position_ids=True, shared_prefix=shared, shifts=[(0, 0), (1, 0)])
        g, packd_ms = timed(lambda: client.pack([tokens, x], mask, **kw))
        h = client.pack([tokens.cpu(), x.cpu()], mask.cpu(), **kw)
        back = client.scatter(g.packed[1], mask, shared_prefix=shared)
        back_h = client.scatter(h.packed[1], mask.cpu(), shared_prefix=shared)
        per_target = client.scatter(g.shifted[1], mask, shared_prefix=shared, targets=True)
        per_target_h = client.scatter(h.shifted[1], mask.cpu(), shared_prefix=shared,
                                      targets=True)
        fields = ("cu_seqlens_q", "cu_seqlens_k", "kv_index", "pred_index",
                  "target_cu_seqlens", "segment_row")
        row("shared prompts (groups of 4)",
            all(same(a.cpu(), b) for a, b in zip(g.packed + g.shifted, h.packed + h.shifted))
            and g.position_ids.tolist() == h.position_ids.tolist()
            and all(getattr(g.shared, f).tolist() == getattr(h.shared, f).tolist()
                    for f in fields)
            and g.shared.kv_index.is_cuda and same(back.cpu(), back_h)
            and same(per_target.cpu(), per_target_h), packd_ms,
            detail="%d stream rows of %d tokens" % (g.total_active, sum(counts)))
        ours = [n for n in client._regions.device_names() if n.startswith("py-gpu-")]
        known = {name for name, _ in client._gpu.allocations.values()}
        row("device regions registered", 0 < len(ours) and set(ours) == known,
            detail="%d regions, one per allocation known" % len(ours))
        check_step(client, gen)
        check_region_lifecycle(address, gen)
    print("gpu client checks: %d failed" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
