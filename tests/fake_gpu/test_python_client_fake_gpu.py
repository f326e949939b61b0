"""The Python client's GPU path end to end without a GPU: a packd_testing server whose cuda is the
fake GPU of tests/fake_gpu, and a client whose device memory is that fake GPU's in this process
(tests/support/fake_gpu_memory.py). The client registers the allocations holding its tensors as
device regions, the server opens them from their IPC handles (memfd, across the two processes)
and writes the results into memory the client allocated; every result is checked byte for byte
against torch.

The two processes number the GPUs differently (the client's cuda:0 is the server's cuda:1), as
CUDA_VISIBLE_DEVICES makes them: the devices travel as UUIDs."""
import os
import threading
import time

import grpc
import pytest
import torch

import packd
from packd.v1 import pack_service_pb2 as pb
from fake_gpu_memory import FakeGpuMemory
from packd_server import PackdServer
from region_requests import region_pack_request
from torch_reference import DTYPES, random_tensor, reference_scatter, same

# This process's GPU i is physical device i; the server's index 0 is physical 1 and 1 is 0.
SERVER_FLAGS = ("--fake_gpu_devices=2", "--fake_gpu_physical=1,0")


@pytest.fixture(scope="module")
def gpu():
    return FakeGpuMemory(os.environ["PACKD_FAKE_GPU_LIB"], devices=2, physical=[0, 1])


@pytest.fixture(scope="module")
def address():
    with PackdServer(*SERVER_FLAGS, binary=os.environ["PACKD_TESTING_BINARY"]) as address:
        yield address


@pytest.fixture
def client(address, gpu):
    with packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu)) as c:
        yield c


def regions(client):
    return {r.name: r for r in client._stub.ListRegions(pb.ListRegionsRequest()).regions}


def random_mask(shape, gen=None):
    return torch.rand(shape, generator=gen) < 0.6


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_scatter_stay_in_device_memory(client, gpu, dtype):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype))
    x = random_tensor(dtype, (5, 33, 3, 2), gen)
    mask = random_mask((5, 33), gen)
    synced = gpu.synchronized
    r = client.pack(gpu.put(x, 0), gpu.put(mask, 0), with_position_ids=True)
    assert gpu.synchronized > synced  # the GPU's queued work done before packd reads
    assert gpu.device_of(r.packed) == 0 and gpu.device_of(r.cu_seqlens) == 0
    assert same(r.packed, x[mask])
    assert r.cu_seqlens.tolist() == [0] + mask.sum(1).cumsum(0).tolist()
    dense = client.scatter(r.packed, gpu.put(mask, 0))
    assert gpu.device_of(dense) == 0
    assert same(dense, reference_scatter(x[mask], mask, x))


def test_devices_travel_as_uuids(client, gpu):
    """The client's cuda:0 is the server's cuda:1: the region is registered by UUID, opened on
    the server's index for it, and the server lists both devices with their UUIDs."""
    x, mask = gpu.put(torch.randn(2, 8, 4), 0), gpu.put(random_mask((2, 8)), 0)
    client.pack(x, mask)
    info = {d.uuid: d.name for d in client.info().devices if d.kind == "cuda"}
    assert info == {gpu.uuid(0): "cuda:1", gpu.uuid(1): "cuda:0"}
    mine = [r for r in regions(client).values() if r.name.startswith("py-gpu-")]
    assert mine and {r.device for r in mine} == {"cuda:1"}
    # The other device works too, and lands on the server's cuda:0.
    y, m1 = gpu.put(torch.randn(3, 5, 2), 1), gpu.put(random_mask((3, 5)), 1)
    assert same(client.pack(y, m1).packed, y[m1])
    assert "cuda:0" in {r.device for r in regions(client).values()}


def test_an_unknown_uuid_is_failed_precondition(client, gpu):
    request = pb.RegisterDeviceRegionRequest(
        name="unknown-uuid", ipc_handle=b"\0" * 64, device="cuda:0", byte_size=64,
        device_uuid="GPU-00000000-0000-0000-0000-000000000bad")
    with pytest.raises(grpc.RpcError) as e:
        client._stub.RegisterDeviceRegion(request)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU-00000000-0000-0000-0000-000000000bad" in e.value.details()
    r = pb.PackRequest(device="uuid:GPU-00000000-0000-0000-0000-000000000bad")
    r.mask.dtype = pb.DTYPE_BOOL
    r.mask.shape.extend([1, 1])
    r.mask.data = b"\1"
    with pytest.raises(grpc.RpcError) as e:
        client._stub.Pack(r)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_each_allocation_is_registered_once(client, gpu):
    x, mask = gpu.put(torch.randn(4, 16, 8), 0), gpu.put(random_mask((4, 16)), 0)
    client.pack(x, mask)
    first = set(regions(client))
    for _ in range(3):
        client.pack(x, mask)
    # The results are new allocations each time; the inputs' regions are the ones of the first
    # call, and the results freed since have been unregistered.
    names = {name for name, _ in client._gpu.allocations.values()}
    assert client._gpu.allocations[(0, gpu.allocation(x).base)][0] in first
    assert names <= set(regions(client))


def test_differentiable_pack_forward_and_backward(address, gpu):
    op = packd.RemotePackOp(packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu)))
    gen = torch.Generator().manual_seed(7)
    x = gpu.put(torch.randn(3, 10, 4, generator=gen), 0).requires_grad_()
    mask = gpu.put(random_mask((3, 10), gen), 0)
    packed, cu_seqlens = op(x, mask)
    assert gpu.device_of(packed) == 0
    assert same(packed.detach(), x.detach()[mask])
    weight = torch.randn(packed.shape, generator=gen)
    (packed * weight).sum().backward()
    assert same(x.grad, reference_scatter(weight, mask, x.detach()))
    op.close()


def test_mixed_devices_are_a_value_error_naming_both(client, gpu):
    x = gpu.put(torch.randn(2, 4, 3), 0)
    with pytest.raises(ValueError, match=r"mask is on cpu but inputs\[0\] is on cuda:0"):
        client.pack(x, random_mask((2, 4)))
    with pytest.raises(ValueError, match=r"mask is on cuda:1 but inputs\[0\] is on cuda:0"):
        client.pack(x, gpu.put(random_mask((2, 4)), 1))
    with pytest.raises(ValueError, match=r"packed\[1\] is on cpu"):
        client.scatter([gpu.put(torch.randn(3, 2), 0), torch.randn(3, 2)],
                       gpu.put(random_mask((2, 4)), 0))


def test_host_tensors_keep_the_host_path(client, gpu):
    x, mask = torch.randn(3, 7, 2), random_mask((3, 7))
    r = client.pack(x, mask)
    assert gpu.device_of(r.packed) is None and same(r.packed, x[mask])


def test_a_lease_that_ran_out_is_registered_again(address, gpu):
    with packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu, lease_seconds=1)) as client:
        x, mask = gpu.put(torch.randn(4, 9, 3), 0), gpu.put(random_mask((4, 9)), 0)
        client.pack(x, mask)
        name = client._gpu.allocations[(0, gpu.allocation(x).base)][0]
        deadline = time.time() + 10
        while name in regions(client) and time.time() < deadline:
            time.sleep(0.1)
        assert name not in regions(client), "the lease did not run out"
        assert same(client.pack(x, mask).packed, x[mask])  # registered again, transparently
        assert name in regions(client)


def test_device_regions_have_their_own_shorter_lease(client, gpu):
    x, mask = gpu.put(torch.randn(2, 5, 3), 0), gpu.put(random_mask((2, 5)), 0)
    client.pack(x, mask)
    name = client._gpu.allocations[(0, gpu.allocation(x).base)][0]
    assert regions(client)[name].lease_seconds == 10


def test_register_cuda_tensor_addresses_a_tensor_inside_its_allocation(client, gpu):
    """register_cuda_tensor registers the whole allocation (the driver's base, size and 64-byte
    handle) with the device's UUID, and the slice's offset is the tensor's distance from the
    allocation's start: a Pack naming the slice packs exactly that tensor."""
    whole = gpu.put(torch.randn(5 + 4 * 9 * 3), 0)
    x = whole[5:].view(4, 9, 3)
    alloc = gpu.allocation(x)
    s = client.register_cuda_tensor("mine", x)
    assert (s.region, s.offset, s.byte_size) == ("mine", 5 * 4, x.numel() * 4)
    assert s.offset == x.data_ptr() - alloc.base
    info = regions(client)["mine"]
    assert info.byte_size == alloc.size and info.kind == "device"
    mask = random_mask((4, 9))
    request = region_pack_request("uuid:" + client._gpu.uuid(0), mask, s, pb.DTYPE_FLOAT32,
                                  [4, 9, 3])
    packed = client._stub.Pack(request).packed[0]
    got = torch.frombuffer(bytearray(packed.data), dtype=torch.float32).view(-1, 3)
    assert same(got, x.cpu()[mask])
    client.unregister_region("mine")
    assert "mine" not in regions(client)
    with pytest.raises(ValueError, match="contiguous GPU tensor"):
        client.register_cuda_tensor("host", torch.randn(3))


def test_unregister_gpu_regions_lets_the_memory_go_and_calls_register_again(client, gpu):
    """Before torch.cuda.empty_cache: every device region the client registered is gone from
    the server at once; the next call registers what it needs again, one region per
    allocation."""
    x, mask = gpu.put(torch.randn(4, 8, 2), 0), gpu.put(random_mask((4, 8)), 0)
    client.pack(x, mask)
    assert any(r.kind == "device" for r in regions(client).values())
    client.unregister_gpu_regions()
    assert not any(r.kind == "device" for r in regions(client).values())
    for _ in range(3):
        assert same(client.pack(x, mask).packed, x.cpu()[mask])
    devices = [r for r in regions(client).values() if r.kind == "device"]
    # The inputs' two allocations, once each (results freed since are unregistered).
    inputs = {client._gpu.allocations[(0, gpu.allocation(t).base)][0] for t in (x, mask)}
    assert inputs <= {r.name for r in devices}
    assert len(devices) <= len(client._gpu.allocations)


def test_freed_memory_is_unregistered_and_never_read_again(client, gpu):
    """An allocation freed after a call: its region goes, and memory allocated later (at the
    same address, as allocators do) is read afresh."""
    mask = gpu.put(random_mask((4, 32)), 0)
    x = gpu.put(torch.randn(4, 32, 16), 0)
    client.pack(x, mask)
    name = client._gpu.allocations[(0, gpu.allocation(x).base)][0]
    del x
    y = gpu.put(torch.randn(4, 32, 16), 0)
    assert same(client.pack(y, mask).packed, y[mask])
    assert name not in regions(client)


def test_a_region_freed_while_a_call_uses_it(gpu):
    """The client drops a region while the server still runs a call on it (packd_testing holds
    every call 1.5 s): the call completes on memory it holds, and the region is gone after."""
    with PackdServer(*SERVER_FLAGS, "--call_delay_ms=1500",
                     binary=os.environ["PACKD_TESTING_BINARY"]) as address, \
            packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu)) as client:
        x, mask = gpu.put(torch.randn(2, 16, 4), 0), gpu.put(random_mask((2, 16)), 0)
        want = x[mask].clone()
        client.pack(x, mask)  # registers x's allocation
        name = client._gpu.allocations[(0, gpu.allocation(x).base)][0]
        got = {}
        call = threading.Thread(target=lambda: got.update(r=client.pack(x, mask)))
        call.start()
        time.sleep(0.5)  # the call holds the region now
        client._call(client._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name))
        call.join()
        assert same(got["r"].packed, want)
        assert name not in regions(client)


def test_close_unregisters_every_device_region(address, gpu):
    client = packd.Client(address, gpu=packd.GpuOptions(device_memory=gpu))
    x, mask = gpu.put(torch.randn(2, 4, 3), 0), gpu.put(random_mask((2, 4)), 0)
    client.pack(x, mask)
    names = {name for name, _ in client._gpu.allocations.values()}
    client.close()
    with packd.Client(address) as other:
        assert not names & set(regions(other))


def test_a_layout_on_the_gpu_equals_the_host_layout(client, gpu):
    """Documents, padding, a CP slice, a shift and seq_idx on device tensors: the server's GPU
    path gives the host path's bytes and arrays, and Scatter with the layout inverts it."""
    gen = torch.Generator().manual_seed(11)
    x = random_tensor(torch.bfloat16, (3, 20, 4), gen)
    mask = random_mask((3, 20), gen)
    ids = torch.randint(0, 3, (3, 20), generator=gen)
    kw = dict(with_position_ids=True,
              layout=packd.Layout(pad_multiple=8, cp_size=2, cp_rank=1, with_seq_idx=True,
                                  shifts=[(0, 0)], pad_values=[1]))
    g = client.pack(gpu.put(x, 0), gpu.put(mask, 0), segment_ids=gpu.put(ids, 0), **kw)
    h = client.pack(x, mask, segment_ids=ids, **kw)
    assert gpu.device_of(g.packed) == 0 and gpu.device_of(g.shifted[0]) == 0
    assert same(g.packed, h.packed) and same(g.shifted[0], h.shifted[0])
    assert g.cu_seqlens_padded.tolist() == h.cu_seqlens_padded.tolist()
    assert g.seq_idx.tolist() == h.seq_idx.tolist()
    back = client.scatter(g.packed, gpu.put(mask, 0), segment_ids=gpu.put(ids, 0),
                          layout=packd.Layout(pad_multiple=8, cp_size=2, cp_rank=1))
    want = client.scatter(h.packed, mask, segment_ids=ids,
                          layout=packd.Layout(pad_multiple=8, cp_size=2, cp_rank=1))
    assert gpu.device_of(back) == 0 and same(back, want)


def test_shared_prompts_on_the_gpu_equal_the_host_stream(client, gpu):
    """GRPO groups packed with their prompt once from device tensors: the stream, its targets
    (a shift in target space) and metadata equal the host path's, and both Scatters (stream
    and targets) invert them on the device."""
    gen = torch.Generator().manual_seed(13)
    B, S = 6, 24
    lengths = torch.randint(8, S + 1, (B,), generator=gen)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    tokens = torch.randint(0, 100, (B, S), generator=gen)
    groups = [7, 3, 7, 7, 3, 9]
    for b in range(B):  # each member's prompt its group's first row's
        tokens[b, :6] = tokens[groups.index(groups[b]), :6]
    shared = packd.SharedPrefix(groups, [6] * B, same_inputs=(0,))
    x = random_tensor(torch.float32, (B, S, 3), gen)
    kw = dict(with_position_ids=True,
              layout=packd.Layout(with_seq_idx=True, shared_prefix=shared,
                                  shifts=[(0, 0), (1, 0)]))
    g = client.pack([gpu.put(tokens, 0), gpu.put(x, 0)], gpu.put(mask, 0), **kw)
    h = client.pack([tokens, x], mask, **kw)
    for a, b in zip(g.packed + g.shifted, h.packed + h.shifted):
        assert gpu.device_of(a) == 0 and same(a, b)
    assert g.position_ids.tolist() == h.position_ids.tolist()
    assert g.seq_idx.tolist() == h.seq_idx.tolist()
    for name in ("cu_seqlens_q", "cu_seqlens_k", "kv_index", "pred_index",
                 "target_cu_seqlens", "segment_row"):
        assert getattr(g.shared, name).tolist() == getattr(h.shared, name).tolist(), name
    assert gpu.device_of(g.shared.kv_index) == 0
    back = client.scatter(g.packed[1], gpu.put(mask, 0), layout=packd.Layout(shared_prefix=shared))
    assert gpu.device_of(back) == 0
    assert same(back, client.scatter(h.packed[1], mask, layout=packd.Layout(shared_prefix=shared)))
    per_target = client.scatter(g.shifted[1], gpu.put(mask, 0),
                                layout=packd.Layout(shared_prefix=shared), targets=True)
    assert same(
        per_target,
        client.scatter(h.shifted[1], mask, layout=packd.Layout(shared_prefix=shared), targets=True))
    # A prompt that differs is the named error, from the device tensors too.
    tokens[2, 3] += 1
    with pytest.raises(ValueError, match=r"inputs\[0\] differs across group 7: row 2's "
                                         r"prompt token 3"):
        client.pack([gpu.put(tokens, 0), gpu.put(x, 0)], gpu.put(mask, 0), **kw)


def test_threads_sharing_one_client_on_the_gpu_path(client, gpu):
    """Six threads share one client: each packs and scatters its own device tensors, and all of
    them one shared allocation, at once; every result is its own, and the shared allocation
    ends with one region however many threads registered it."""
    gen = torch.Generator().manual_seed(5)
    shared_host = torch.randn(4, 24, 6, generator=gen)
    shared = gpu.put(shared_host, 0)
    failures = []

    def work(t):
        g = torch.Generator().manual_seed(100 + t)
        for i in range(10):
            host = shared_host if i % 3 == 0 else random_tensor(torch.bfloat16, (4, 24, 6), g)
            x = shared if i % 3 == 0 else gpu.put(host, t % 2)
            mask_host = random_mask((4, 24), g)
            mask = gpu.put(mask_host, 0 if i % 3 == 0 else t % 2)
            try:
                r = client.pack(x, mask)
                assert same(r.packed, host[mask_host])
                dense = client.scatter(r.packed, mask)
                assert same(dense, reference_scatter(host[mask_host], mask_host, host))
            except Exception as e:  # an assert in a thread fails nothing by itself
                failures.append("thread %d call %d: %r" % (t, i, e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures[:5]
    # A duplicate goes with the next call: one with a layout, whose results come inline, so
    # that no output of the shared tensor's size is registered beside it.
    client.pack(shared, gpu.put(random_mask((4, 24)), 0), layout=packd.Layout(pad_multiple=1))
    size = shared.numel() * shared.element_size()
    assert sum(r.byte_size == size for r in regions(client).values()) == 1


def test_flash_attn_drop_in_on_the_gpu(client, gpu):
    """packd.flash_attn with device tensors: results in device memory, equal to the host run;
    the gradient of unpad then pad comes back in device memory."""
    from packd import flash_attn
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 17, 3, dtype=torch.float64, generator=gen)
    mask = random_mask((4, 17), gen)
    mask[:, 0] = True
    dx = gpu.put(x, 0).requires_grad_()
    unpadded, indices, cu, longest, seqused = flash_attn.unpad_input(
        dx, gpu.put(mask, 0), client=client)
    assert gpu.device_of(unpadded) == 0 and gpu.device_of(indices) == 0
    assert same(unpadded.detach(), x[mask])
    assert indices.tolist() == torch.nonzero(mask.flatten()).flatten().tolist()
    assert cu.dtype == torch.int32 and cu.tolist() == [0] + mask.sum(1).cumsum(0).tolist()
    assert longest == int(mask.sum(1).max()) and seqused.tolist() == mask.sum(1).tolist()
    # (torch's own arithmetic on these tensors lands in host memory: none between the two.)
    padded = flash_attn.pad_input(unpadded, indices, 4, 17, client=client)
    assert gpu.device_of(padded) == 0
    assert same(padded.detach(), reference_scatter(x[mask], mask, x))
    upstream = torch.randn(4, 17, 3, dtype=torch.float64, generator=gen)
    (padded * upstream).sum().backward()
    assert same(dx.grad, reference_scatter(upstream[mask], mask, x))


def _step_batch(gen, B=10, S=40):
    lengths = torch.randint(6, S + 1, (B,), generator=gen)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    tokens = torch.randint(0, 1000, (B, S), generator=gen)
    for b in range(1, B, 2):  # pairs share a 6-token prompt
        tokens[b, :6] = tokens[b - 1, :6]
    x = random_tensor(torch.bfloat16, (B, S, 3), gen)
    ids = torch.randint(0, 3, (B, S), generator=gen).cumsum(1)
    return mask, tokens, x, ids


STEP_LAYOUTS = {
    "documents": dict(segment_ids=True),
    "padding": dict(pad_multiple=8, pad_values=[-1, 0], with_seq_idx=True),
    "cp": dict(pad_multiple=4, cp_size=2, cp_rank=1),
    "ulysses": dict(sp_size=2, sp_rank=1),
    "fixed": dict(fixed=(160, 24, 160)),
    "shared_prompts": dict(shared_prefix=packd.SharedPrefix([b // 2 for b in range(10)],
                                                            [6] * 10, same_inputs=(0,))),
}


def _micro_batches(step):
    return {(mb.rank, mb.index): mb for mb in step}


@pytest.mark.parametrize("layout", sorted(STEP_LAYOUTS))
def test_a_step_on_the_gpu_equals_the_host_step(client, gpu, layout):
    """pack_micro_batches with every tensor on the GPU: the same plan, and every micro-batch's
    results equal the host step's, as tensors on that GPU; from the second step of a shape on
    they are views of an arena packd wrote on the GPU, and an earlier step's results stay
    intact while a later step runs."""
    gen = torch.Generator().manual_seed(sorted(STEP_LAYOUTS).index(layout))
    mask, tokens, x, ids = _step_batch(gen)
    loss_mask = mask & (torch.rand(mask.shape, generator=gen) < 0.8)
    fields = dict(STEP_LAYOUTS[layout])
    use_ids = fields.pop("segment_ids", False)
    kw = dict(plan=packd.PlanOptions(num_ranks=2), with_position_ids=True,
              layout=packd.Layout(shifts=[(0, -100)], **fields))

    def run(on_gpu):
        put = (lambda t: gpu.put(t, 0)) if on_gpu else (lambda t: t)
        return client.pack_micro_batches(
            [put(tokens), put(x)], put(mask), 80, loss_mask=put(loss_mask),
            segment_ids=put(ids) if use_ids else None, **kw)

    # A new client's first step has no arena yet (its results come inline), the next has.
    first = run(True)
    steps = [_micro_batches(first)]
    assert first.through_shared_memory == 0
    host = run(False)
    want = _micro_batches(host)
    second = run(True)
    steps.append(_micro_batches(second))
    third = run(True)  # its own arena: the second's results are still the second's
    steps.append(_micro_batches(third))
    assert second.through_shared_memory == third.through_shared_memory == len(want)
    for step, got in zip((first, second, third), steps):
        assert step.plan.micro_batches == host.plan.micro_batches
        assert step.plan.global_loss_tokens == host.plan.global_loss_tokens
        assert sorted(got) == sorted(want)
    for got in steps:
        for key, mb in got.items():
            h = want[key].result
            assert mb.samples == want[key].samples
            for a, b in zip(mb.result.packed + mb.result.shifted, h.packed + h.shifted):
                assert gpu.device_of(a) == 0 and same(a, b), (layout, key)
            assert mb.result.cu_seqlens.tolist() == h.cu_seqlens.tolist()
            assert mb.result.position_ids.tolist() == h.position_ids.tolist()
            # The metadata too are on the GPU, as the results are (docs/gpu.md).
            assert gpu.device_of(mb.result.cu_seqlens) == 0
            assert gpu.device_of(mb.result.position_ids) == 0


def test_steps_from_threads_sharing_one_client_on_the_gpu(client, gpu):
    """Four threads share one client, each running steps on its own device batch: every
    micro-batch equals its host step's."""
    failures = []

    def work(t):
        gen = torch.Generator().manual_seed(200 + t)
        mask, tokens, x, ids = _step_batch(gen)
        want = _micro_batches(
            client.pack_micro_batches([tokens, x], mask, 80, plan=packd.PlanOptions(num_ranks=2)))
        try:
            for _ in range(3):
                got = _micro_batches(
                    client.pack_micro_batches(
                        [gpu.put(tokens, 0), gpu.put(x, 0)], gpu.put(mask, 0), 80,
                        plan=packd.PlanOptions(num_ranks=2)))
                assert sorted(got) == sorted(want)
                for key, mb in got.items():
                    for a, b in zip(mb.result.packed, want[key].result.packed):
                        assert gpu.device_of(a) == 0 and same(a, b)
        except Exception as e:  # an assert in a thread fails nothing by itself
            failures.append("thread %d: %r" % (t, e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures[:4]


def test_a_step_with_tensors_on_two_devices_is_a_value_error(client, gpu):
    mask, tokens, x, _ = _step_batch(torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"mask is on cuda:0 but inputs\[0\] is on cuda:1"):
        client.pack_micro_batches([gpu.put(tokens, 1)], gpu.put(mask, 0), 80)
    with pytest.raises(ValueError, match=r"mask is on cpu but inputs\[0\] is on cuda:0"):
        client.pack_micro_batches([gpu.put(tokens, 0)], mask, 80)


def test_unregister_gpu_regions_while_threads_call(client, gpu):
    """unregister_gpu_regions from one thread while four others pack, scatter and step on the
    GPU with the same client: every call succeeds with its own results (a call whose regions
    went meanwhile registers them again), and the regions left are those of the last calls."""
    failures = []
    stop = threading.Event()

    def work(t):
        g = torch.Generator().manual_seed(300 + t)
        for i in range(12):
            host = random_tensor(torch.float16, (4, 24, 3), g)
            mask_host = random_mask((4, 24), g)
            try:
                x, mask = gpu.put(host, 0), gpu.put(mask_host, 0)
                r = client.pack(x, mask)
                assert same(r.packed, host[mask_host])
                assert same(client.scatter(r.packed, mask),
                            reference_scatter(host[mask_host], mask_host, host))
                if i % 4 == 0:
                    for mb in client.pack_micro_batches([x], mask, 40):
                        assert same(mb.result.packed[0],
                                    host[mb.samples][mask_host[mb.samples]])
            except Exception as e:  # an assert in a thread fails nothing by itself
                failures.append("thread %d call %d: %r" % (t, i, e))

    def unregister():
        while not stop.is_set():
            try:
                client.unregister_gpu_regions()
            except Exception as e:
                failures.append("unregister_gpu_regions: %r" % e)
            time.sleep(0.02)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    remover = threading.Thread(target=unregister)
    remover.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    remover.join()
    assert not failures, failures[:5]
    client.unregister_gpu_regions()
    assert not [n for n in regions(client) if n.startswith("py-gpu-")]
