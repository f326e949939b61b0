"""packd/_wire.py against protobuf: what it writes is the protobuf encoding, what it reads is what
protobuf reads, with tensors over the received bytes."""
import torch

from packd import _wire
from packd.v1 import pack_service_pb2 as pb


def _request():
    mask = torch.rand(3, 5) < 0.5
    x = torch.randn(3, 5, 4).to(torch.bfloat16)
    outgoing = _wire.Outgoing(pb.PackRequest(device="cpu", with_position_ids=True))
    header = pb.Tensor(dtype=pb.DTYPE_BOOL, shape=[3, 5])
    outgoing.add(1, header, memoryview(mask.view(torch.uint8).numpy()))
    header = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[3, 5, 4])
    outgoing.add(2, header, memoryview(x.view(torch.int16).numpy()))
    handle = pb.Tensor(dtype=pb.DTYPE_INT8, shape=[3, 5],
                       region=pb.RegionSlice(region="r", offset=8, byte_size=15))
    outgoing.add(2, handle)
    outgoing.add(2, pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3, 5, 0]),
                 memoryview(torch.empty(0).numpy()))
    return outgoing, mask, x


def test_requests_are_protobuf_messages():
    outgoing, mask, x = _request()
    parsed = pb.PackRequest.FromString(_wire.serialize(outgoing))
    assert parsed.device == "cpu" and parsed.with_position_ids
    assert parsed.mask.data == mask.view(torch.uint8).numpy().tobytes()
    assert list(parsed.inputs[0].shape) == [3, 5, 4]
    assert parsed.inputs[0].data == x.view(torch.int16).numpy().tobytes()
    assert parsed.inputs[1].region.region == "r" and not parsed.inputs[1].data
    assert parsed.inputs[2].HasField("data") and parsed.inputs[2].data == b""


def test_the_declared_size_is_the_serialized_size():
    outgoing, _, _ = _request()
    assert _wire.serialized_size(outgoing) == len(_wire.serialize(outgoing))
    # Lengths of one, two and three varint bytes, and an empty message.
    for n in (0, 1, 100, 127, 128, 16383, 16384, 70000):
        big = _wire.Outgoing(pb.ScatterRequest())
        big.add(2, pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[n]),
                memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy()))
        assert _wire.serialized_size(big) == len(_wire.serialize(big)), n


def test_replies_parse_like_protobuf_with_tensors_over_the_bytes():
    packed = torch.randn(7, 3)
    reply = pb.PackResponse(cu_seqlens=[0, 3, 7], total_active=7, max_seqlen=4,
                            last_index=[2, 4], doc_row=[0, 1])
    reply.packed.add(dtype=pb.DTYPE_FLOAT32, shape=[7, 3],
                     data=packed.numpy().tobytes())
    reply.packed.add(dtype=pb.DTYPE_INT8, shape=[7],
                     region=pb.RegionSlice(region="r", offset=0, byte_size=7))
    reply.packed.add(dtype=pb.DTYPE_INT64, shape=[0, 2], data=b"")
    buf = reply.SerializeToString()
    message, tensors = _wire.parser(pb.PackResponse, pb.Tensor)(buf)
    assert list(message.cu_seqlens) == [0, 3, 7] and message.total_active == 7
    assert list(message.doc_row) == [0, 1]
    assert len(message.packed) == 3 and message.packed[1].region.region == "r"
    first, region, empty = tensors[1]
    assert torch.equal(first, packed)
    assert region is None
    assert empty.shape == (0, 2) and empty.dtype == torch.int64


def test_truncated_replies_are_refused():
    reply = pb.PackResponse(cu_seqlens=[0, 3])
    reply.packed.add(dtype=pb.DTYPE_UINT8, shape=[3], data=b"abc")
    buf = reply.SerializeToString()
    parse = _wire.parser(pb.PackResponse, pb.Tensor)
    for n in range(1, len(buf)):
        try:
            message, tensors = parse(buf[:n])
        except Exception:  # noqa: BLE001 - refused is the point
            continue
        # A prefix that parses is a valid shorter message: protobuf agrees.
        expected = pb.PackResponse.FromString(buf[:n])
        assert len(message.packed) == len(expected.packed)


def test_repeated_fields_are_told_apart_on_every_protobuf():
    """_wire.is_repeated on every field of packd.v1, against the labels the file's own descriptor
    proto records (FieldDescriptorProto.label, a message field every runtime keeps): protobuf
    4.21 has only FieldDescriptor.label, 7.x only is_repeated."""
    from google.protobuf import descriptor_pb2

    file_proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file_proto)
    expected = {}

    def walk(messages, prefix):
        for m in messages:
            for f in m.field:
                expected[f"{prefix}{m.name}.{f.name}"] = (
                    f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
            walk(m.nested_type, f"{prefix}{m.name}.")

    walk(file_proto.message_type, "packd.v1.")
    got = {}

    def visit(descriptor):
        for f in descriptor.fields:
            got[f.full_name] = _wire.is_repeated(f)
        for nested in descriptor.nested_types:
            visit(nested)

    for message in pb.DESCRIPTOR.message_types_by_name.values():
        visit(message)
    assert got == expected
    assert sum(got.values()) >= 10  # packd.v1 has repeated fields to tell apart


def test_repeated_int64_fields_become_tensors_exactly():
    """results.int64_tensor: numpy's array protocol where protobuf offers it (upb), else a
    list; either way the field's values, int64, in a tensor of its own."""
    from packd.results import int64_tensor
    rng = torch.Generator().manual_seed(3)
    values = torch.randint(-2**62, 2**62, (20000,), generator=rng).tolist()
    values[:4] = [-1, 0, 2**63 - 1, -2**63]
    reply = pb.PackResponse.FromString(pb.PackResponse(position_ids=values).SerializeToString())
    got = int64_tensor(reply.position_ids)
    assert got.dtype == torch.int64 and got.tolist() == values
    got[0] = 5  # its own memory: the message is unchanged
    assert reply.position_ids[0] == -1
    empty = int64_tensor(pb.PackResponse().last_index)
    assert empty.dtype == torch.int64 and empty.shape == (0,)
