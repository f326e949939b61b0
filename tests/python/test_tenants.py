"""Tenants by unix-socket uid (docs/service.md, "Tenants"): on packd's unix socket each peer is
the tenant of its uid. Two clients run as two other users (the test runs as root): B cannot list,
read, write, unregister or name the key of A's region, nor have packd open a segment B does not
own (the confused deputy), and A's region and bytes are as they were.

The clients are plain gRPC programs run by Debian's python3 with packd's stubs copied where any
user can read them: the users have no access to the test's own environment."""
import json
import os
import shutil
import subprocess
import tempfile
from multiprocessing import shared_memory

import pytest

import packd.v1
from packd_server import PackdServer

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="runs two clients as two other users, which needs root and Debian's python3")

USER_A, USER_B = 65534, 65533

# One client's moves, as a user: each prints one JSON line of what packd answered.
CLIENT = r'''
import json, sys
from multiprocessing import shared_memory, resource_tracker
import grpc
from packd.v1 import pack_service_pb2 as pb, pack_service_pb2_grpc as pb_grpc

address, moves = sys.argv[1], json.loads(sys.argv[2])
stub = pb_grpc.PackServiceStub(grpc.insecure_channel(address))

def answer(call, request):
    try:
        response = call(request)
        return {"code": "OK", "response": response}
    except grpc.RpcError as e:
        return {"code": e.code().name, "message": e.details()}

def mask_and(x_field):
    request = pb.PackRequest()
    request.mask.dtype = pb.DTYPE_BOOL
    request.mask.shape.extend([1, 16])
    request.mask.data = b"\1" * 16
    x = request.inputs.add()
    x.dtype = pb.DTYPE_UINT8
    x.shape.extend([1, 16, 4])
    x_field(x)
    return request

out = {}
for move in moves:
    kind = move["kind"]
    if kind == "prefix":
        out[kind] = stub.GetServerInfo(pb.GetServerInfoRequest()).shm_key_prefix
    elif kind == "register":
        if move.get("create"):
            seg = shared_memory.SharedMemory(name=move["key"].lstrip("/"), create=True, size=4096)
            resource_tracker.unregister(seg._name, "shared_memory")  # packd keeps the memory
            seg.buf[:64] = bytes(move["fill"] for _ in range(64))
        got = answer(stub.RegisterSystemRegion, pb.RegisterSystemRegionRequest(
            name=move["name"], key=move["key"], offset=0, byte_size=4096))
        out[kind + ":" + move["name"]] = {"code": got["code"], "message": got.get("message")}
    elif kind == "list":
        got = answer(stub.ListRegions, pb.ListRegionsRequest())
        out[kind] = [r.name for r in got["response"].regions]
    elif kind == "read":
        def in_region(x):
            x.region.region, x.region.offset, x.region.byte_size = move["name"], 0, 64
        got = answer(stub.Pack, mask_and(in_region))
        out[kind] = {"code": got["code"], "message": got.get("message")}
        if got["code"] == "OK":
            out[kind]["bytes"] = list(got["response"].packed[0].data)
    elif kind == "write":
        request = mask_and(lambda x: setattr(x, "data", b"\xee" * 64))
        out_slice = request.outputs.add()
        out_slice.region, out_slice.offset, out_slice.byte_size = move["name"], 0, 64
        got = answer(stub.Pack, request)
        out[kind] = {"code": got["code"], "message": got.get("message")}
    elif kind == "unregister":
        got = answer(stub.UnregisterRegion, pb.UnregisterRegionRequest(name=move["name"]))
        out[kind] = {"code": got["code"], "message": got.get("message")}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def world():
    """A packd on a unix socket any user may reach, and packd's stubs any user may read."""
    public = tempfile.mkdtemp(prefix="packd-tenants-")
    os.chmod(public, 0o755)
    stubs = os.path.join(public, "packd", "v1")
    os.makedirs(stubs)
    source = os.path.dirname(packd.v1.__file__)
    for name in os.listdir(source):
        if name.endswith(".py"):
            shutil.copy(os.path.join(source, name), stubs)
    open(os.path.join(public, "packd", "__init__.py"), "w").close()
    for root, dirs, files in os.walk(public):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    with PackdServer("--shm_key_prefix=/packd_tn") as address:
        os.chmod(os.path.dirname(address[len("unix:"):]), 0o755)
        yield address, public
    shutil.rmtree(public)


def as_user(world, uid, *moves):
    address, public = world
    done = subprocess.run(["/usr/bin/python3", "-c", CLIENT, address, json.dumps(moves)],
                          user=uid, group=uid, env={"PYTHONPATH": public, "HOME": "/tmp"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_unix_peer_is_the_tenant_of_its_uid(world):
    prefix_a = as_user(world, USER_A, {"kind": "prefix"})["prefix"]
    prefix_b = as_user(world, USER_B, {"kind": "prefix"})["prefix"]
    assert prefix_a == "/packd_tnuid_%d." % USER_A and prefix_b == "/packd_tnuid_%d." % USER_B
    key_a = prefix_a + "batch-%d" % os.getpid()
    a = as_user(world, USER_A,
                {"kind": "register", "name": "A-secret", "key": key_a, "create": True,
                 "fill": 0xA5},
                {"kind": "read", "name": "A-secret"}, {"kind": "list"})
    assert a["register:A-secret"]["code"] == "OK", a
    assert a["read"]["code"] == "OK" and a["read"]["bytes"] == [0xA5] * 64
    assert a["list"] == ["A-secret"]

    # The confused deputy: a segment under B's own prefix that root owns, mode 0600.
    deputy_key = prefix_b + "deputy-%d" % os.getpid()
    deputy = shared_memory.SharedMemory(name=deputy_key.lstrip("/"), create=True, size=4096)
    try:
        b = as_user(world, USER_B, {"kind": "list"}, {"kind": "read", "name": "A-secret"},
                    {"kind": "write", "name": "A-secret"},
                    {"kind": "unregister", "name": "A-secret"},
                    {"kind": "register", "name": "stolen", "key": key_a},
                    {"kind": "register", "name": "deputy", "key": deputy_key})
    finally:
        deputy.close()
        deputy.unlink()
    assert b["list"] == []
    for move in ("read", "write", "unregister"):
        assert b[move]["code"] == "NOT_FOUND", (move, b)
        assert 'region "A-secret" is not registered' in b[move]["message"], (move, b)
    assert b["register:stolen"]["code"] == "PERMISSION_DENIED", b
    assert key_a in b["register:stolen"]["message"] and prefix_b in b["register:stolen"]["message"]
    assert b["register:deputy"]["code"] == "PERMISSION_DENIED", b
    assert "not of this caller (uid %d)" % USER_B in b["register:deputy"]["message"], b

    # A's region and bytes are as they were.
    a = as_user(world, USER_A, {"kind": "read", "name": "A-secret"}, {"kind": "list"},
                {"kind": "unregister", "name": "A-secret"})
    assert a["read"]["code"] == "OK" and a["read"]["bytes"] == [0xA5] * 64, a
    assert a["list"] == ["A-secret"] and a["unregister"]["code"] == "OK"
    shared_memory.SharedMemory(name=key_a.lstrip("/")).unlink()
