"""A client written only from the wire contract: Python grpcio with stubs generated from the
.proto files, against the real packd binary. Results must equal torch byte for byte and errors
must carry the documented codes.

Run by ctest; by hand: PACKD_BINARY=build/bin/packd PYTHONPATH=build/python:tests/support \
    /usr/bin/python3 -m pytest -q tests/e2e/test_python_client.py
"""
import os
import random
import threading

import grpc
import pytest
import torch
from packd_server import PackdServer
from torch_reference import bits, random_tensor, raw, reference_scatter

from packd.v1 import pack_service_pb2 as pb
from packd.v1 import pack_service_pb2_grpc as pb_grpc

DTYPES = {
    pb.DTYPE_BOOL: torch.bool, pb.DTYPE_UINT8: torch.uint8, pb.DTYPE_INT8: torch.int8,
    pb.DTYPE_INT16: torch.int16, pb.DTYPE_INT32: torch.int32, pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_FLOAT16: torch.float16, pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_FLOAT64: torch.float64,
}
WIRE = {v: k for k, v in DTYPES.items()}


def to_wire(t):
    t = t.contiguous()
    return pb.Tensor(dtype=WIRE[t.dtype], shape=list(t.shape), data=raw(t))


def from_wire(msg):
    dtype = DTYPES[msg.dtype]
    if len(msg.data) == 0:
        return torch.empty(list(msg.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    if dtype == torch.bool:
        return flat.to(torch.bool).reshape(list(msg.shape))
    return flat.view(dtype).reshape(list(msg.shape))


def same_bytes(expected, msg):
    return (WIRE[expected.dtype] == msg.dtype and list(expected.shape) == list(msg.shape)
            and raw(expected) == msg.data)


def random_mask(dtype, B, S, density, gen):
    active = torch.rand((B, S), generator=gen) < density
    values = torch.where(active, torch.tensor(2.0), torch.tensor(0.0))
    if dtype.is_floating_point:
        values = torch.where(active & (torch.rand((B, S), generator=gen) < 0.3),
                             torch.tensor(float("nan")), values)
        values = torch.where(~active & (torch.rand((B, S), generator=gen) < 0.5),
                             torch.tensor(-0.0), values)
    return values.to(dtype)


@pytest.fixture(scope="module")
def server():
    with PackdServer() as address:
        yield address


@pytest.fixture(scope="module")
def channel(server):
    opts = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    with grpc.insecure_channel(server, options=opts) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.PackServiceStub(channel)


def test_pack_is_bit_exact_for_every_dtype(stub):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    for mask_dtype in DTYPES.values():
        B, S = random.randint(1, 6), random.randint(1, 300)
        mask = random_mask(mask_dtype, B, S, random.random(), gen)
        xs = [random_tensor(dt, (B, S, random.randint(1, 4)), gen) for dt in DTYPES.values()]
        reply = stub.Pack(pb.PackRequest(mask=to_wire(mask), inputs=[to_wire(x) for x in xs],
                                         with_position_ids=True))
        active = mask != 0
        for x, got in zip(xs, reply.packed):
            assert same_bytes(x[active], got)
        counts = active.sum(1)
        assert list(reply.cu_seqlens) == [0] + counts.cumsum(0).tolist()
        assert reply.total_active == int(counts.sum())
        assert reply.max_seqlen == int(counts.max())
        assert list(reply.position_ids) == (active.long().cumsum(1) - 1)[active].tolist()
        s = torch.arange(S).expand(B, S)
        assert list(reply.last_index) == torch.where(active, s, torch.tensor(-1)).amax(1).tolist()


def test_scatter_is_bit_exact_and_inverts_pack(stub):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    for dtype in DTYPES.values():
        mask = random_mask(torch.uint8, 4, 33, 0.4, gen)
        x = random_tensor(dtype, (4, 33, 2, 3), gen)
        packed = stub.Pack(pb.PackRequest(mask=to_wire(mask), inputs=[to_wire(x)])).packed[0]
        dense = stub.Scatter(pb.ScatterRequest(mask=to_wire(mask), packed=[packed],
                                               tail_shape=pb.Shape(dims=[2, 3]))).dense[0]
        packed_ref = bits(x)[mask != 0].view(x.dtype)
        assert same_bytes(reference_scatter(packed_ref, mask, x), dense)


@pytest.mark.parametrize("mutate,code,text", [
    (lambda r: r.inputs[0].CopyFrom(to_wire(torch.zeros(2, 5, 3))), grpc.StatusCode.INVALID_ARGUMENT,
     "inputs[0].shape [2, 5, 3] does not start with mask shape [2, 4]"),
    (lambda r: setattr(r.inputs[0], "data", b"123"), grpc.StatusCode.INVALID_ARGUMENT,
     "inputs[0].data has 3 bytes"),
    (lambda r: setattr(r, "device", "tpu"), grpc.StatusCode.INVALID_ARGUMENT, "is not a device"),
    (lambda r: setattr(r, "device", "cuda:0"), grpc.StatusCode.FAILED_PRECONDITION,
     "cuda:0 is not available"),
    (lambda r: r.ClearField("mask"), grpc.StatusCode.INVALID_ARGUMENT, "mask is missing"),
])
def test_errors_carry_documented_codes(stub, mutate, code, text):
    request = pb.PackRequest(mask=to_wire(torch.ones(2, 4, dtype=torch.bool)),
                             inputs=[to_wire(torch.zeros(2, 4, 3))])
    mutate(request)
    with pytest.raises(grpc.RpcError) as err:
        stub.Pack(request)
    assert err.value.code() == code
    assert text in err.value.details()
    # The server keeps serving.
    ok = stub.Pack(pb.PackRequest(mask=to_wire(torch.ones(2, 4, dtype=torch.bool)),
                                  inputs=[to_wire(torch.zeros(2, 4, 3))]))
    assert ok.total_active == 8


def test_regions_and_server_info(stub):
    assert list(stub.ListRegions(pb.ListRegionsRequest()).regions) == []
    with pytest.raises(grpc.RpcError) as err:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="absent"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.default_device == "cpu" and info.devices[0].name == "cpu"
    assert info.shared_memory_enabled


def test_health_and_reflection(channel):
    # grpc.health.v1 is encoded by hand: Python's own "grpc" package shadows generated
    # grpc/health/v1 stubs. Request: field 1 (service) string; reply: field 1 (status) = 1 SERVING.
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                response_deserializer=None)
    for service in (b"", b"packd.v1.PackService"):
        assert check(b"\x0a" + bytes([len(service)]) + service) == b"\x08\x01"
    # grpc.reflection.v1alpha list_services, encoded by hand: field 7 (list_services) = "".
    call = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=None, response_deserializer=None)
    replies = list(call(iter([b"\x3a\x00"])))
    assert any(b"packd.v1.PackService" in r for r in replies)


def _status_bytes(pid, field):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def test_a_budget_counts_what_calls_hold_not_a_multiple_of_a_guess():
    """24 concurrent 128 MiB bfloat16 Packs at density 0.3 from a plain stub (no
    packd-request-bytes) under a 320 MiB budget: each holds its request, at most one gathered
    copy of it, and its 38 MiB of results, so they run one or two at a time and succeed (each
    was refused as needing 384 MiB when results were counted as large as the inputs and every
    input as gathered), and the server's peak memory stays within the budget plus 512 MiB."""
    budget = 320 << 20
    server = PackdServer("--max_inflight_bytes=%d" % budget)
    with server as address:
        opts = [("grpc.max_send_message_length", 1 << 30),
                ("grpc.max_receive_message_length", 1 << 30)]
        gen = torch.Generator().manual_seed(random.randrange(1 << 30))
        mask = torch.rand((16, 2048), generator=gen) < 0.3
        x = random_tensor(torch.bfloat16, (16, 2048, 2048), gen)  # 128 MiB
        request = pb.PackRequest(mask=to_wire(mask), inputs=[to_wire(x)])
        expected = raw(bits(x)[mask])
        with open("/proc/%d/clear_refs" % server.pid, "w") as f:
            f.write("5")  # VmHWM from now on
        before = _status_bytes(server.pid, "VmRSS:")
        results = []

        def call():
            with grpc.insecure_channel(address, options=opts) as ch:
                try:
                    reply = pb_grpc.PackServiceStub(ch).Pack(request, timeout=300)
                    results.append(reply.packed[0].data == expected)
                except grpc.RpcError as e:
                    results.append(e.code())

        threads = [threading.Thread(target=call) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = _status_bytes(server.pid, "VmHWM:")
    print("peak resident memory %.0f MiB (%.0f MiB before)" % (peak / 2**20, before / 2**20))
    assert results.count(True) >= 20, results
    assert all(r is True or r == grpc.StatusCode.RESOURCE_EXHAUSTED for r in results), results
    if "ASAN_OPTIONS" not in os.environ:  # a sanitizer's allocator keeps freed memory
        assert peak <= budget + (512 << 20), peak
