"""packd.v1 messages with tensor bytes kept out of protobuf.

A request is one hand-built join of protobuf-encoded headers and the tensors' own bytes (the one
copy on the way out); a reply is parsed in place, its tensors built over the received buffer (no
copy on the way in). The bytes are exactly the protobuf encoding of the message, so the server sees
an ordinary packd.v1 message.
"""
import warnings

import torch

from packd import _tensors

_LEN = 2
_DATA = 3  # packd.v1.Tensor.data


def _varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number, wire_type):
    return _varint((number << 3) | wire_type)


class Outgoing:
    """A request: `message` holds every field but the tensors; `tensors` lists (field number,
    packd.v1.Tensor header, bytes-like data or None) in order, and message fields that hold
    tensors of their own as (field number, Outgoing, None)."""

    def __init__(self, message):
        self.message = message
        self.tensors = []

    def add(self, number, header, data=None):
        self.tensors.append((number, header, data))

    def add_message(self, number, outgoing):
        """Field `number` is `outgoing`, a message with tensors (PackMicroBatchesRequest.batch)."""
        self.tensors.append((number, outgoing, None))


def length_delimited(number, data):
    """Field `number` of a message, `data` its bytes (a string, bytes or a message)."""
    return _tag(number, _LEN) + _varint(len(data)) + data


def _field_bytes(number, payload):
    """Bytes of a length-delimited field `number` with `payload` bytes."""
    return len(_tag(number, _LEN)) + len(_varint(payload)) + payload


def serialized_size(outgoing):
    """len(serialize(outgoing)), without serializing."""
    size = outgoing.message.ByteSize()
    for number, header, data in outgoing.tensors:
        if isinstance(header, Outgoing):
            size += _field_bytes(number, serialized_size(header))
            continue
        head = header.ByteSize()
        if data is not None:
            head = _field_bytes(_DATA, data.nbytes) + head
        size += _field_bytes(number, head)
    return size


def _pieces(outgoing, pieces):
    pieces.append(outgoing.message.SerializeToString())
    for number, header, data in outgoing.tensors:
        if isinstance(header, Outgoing):
            pieces += [_tag(number, _LEN), _varint(serialized_size(header))]
            _pieces(header, pieces)
            continue
        head = header.SerializeToString()
        if data is None:
            pieces += [_tag(number, _LEN), _varint(len(head)), head]
            continue
        n = data.nbytes
        inner = head + _tag(_DATA, _LEN) + _varint(n)
        pieces += [_tag(number, _LEN), _varint(len(inner) + n), inner, data]
    return pieces


def serialize(outgoing):
    return b"".join(_pieces(outgoing, []))


class Reader:
    """Protobuf's wire format read from buf[0:end], every field's bounds checked."""

    def __init__(self, buf, end):
        self.buf, self.at, self.end = buf, 0, end

    def varint(self):
        value, shift = 0, 0
        while True:
            if self.at >= self.end or shift > 63:
                raise ValueError("packd reply: a varint is cut off or too long")
            byte = self.buf[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def skip(self, wire_type):
        if wire_type == 0:
            self.varint()
        elif wire_type == 1:
            self.at += 8
        elif wire_type == 2:
            n = self.varint()
            self.at += n
        elif wire_type == 5:
            self.at += 4
        else:
            raise ValueError("packd reply: wire type %d" % wire_type)
        if self.at > self.end:
            raise ValueError("packd reply: a field runs past the end")


def _tensor(buf, start, end, tensor_type):
    """A packd.v1.Tensor header and a torch tensor over its inline bytes (None for a region)."""
    reader = Reader(buf, end)
    reader.at = start
    rest, data = [], None
    while reader.at < end:
        field_start = reader.at
        tag = reader.varint()
        if tag == (_DATA << 3) | _LEN:
            n = reader.varint()
            data = (reader.at, n)
            reader.at += n
            if reader.at > end:
                raise ValueError("packd reply: tensor data runs past the end")
            continue
        reader.skip(tag & 7)
        rest.append(buf[field_start:reader.at])
    header = tensor_type.FromString(b"".join(rest))
    if header.HasField("region"):
        return header, None
    dtype = _tensors.FROM_WIRE.get(header.dtype)
    if dtype is None:
        raise ValueError("packd reply: dtype %d" % header.dtype)
    shape = list(header.shape)
    offset, n = data if data is not None else (0, 0)
    if n == 0:
        return header, torch.empty(shape, dtype=dtype)
    # The reply's buffer is immutable bytes that only this tensor refers to (torch's warning
    # about that is silenced once per message, in parse).
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if flat.data_ptr() % itemsize:
        flat = flat.clone()  # the dtype's alignment, which torch's kernels expect
    return header, flat.view(dtype).reshape(shape)


def _holds_tensors(message_type, depth=0):
    """Whether messages of this type hold packd.v1.Tensor fields, in themselves or below."""
    if message_type is None or message_type.name == "Tensor" or depth > 3:
        return False
    return any(f.message_type is not None and (f.message_type.name == "Tensor"
                                               or _holds_tensors(f.message_type, depth + 1))
               for f in message_type.fields)


def parser(message_type, tensor_type):
    """A response deserializer: bytes -> (message, {field number: [torch tensor or None]}).
    The message has every field; its tensors carry no data (the torch tensors do). A message
    field that holds tensors (PackMicroBatchesResponse.packed) maps to [(message, {...})]."""
    descriptor = message_type.DESCRIPTOR
    tensor_fields = {f.number for f in descriptor.fields
                     if f.message_type is not None and f.message_type.name == "Tensor"}
    nested = {f.number: parser(message_type_of(message_type, f), tensor_type)
              for f in descriptor.fields
              if f.number not in tensor_fields and _holds_tensors(f.message_type)}

    def parse(buf, start=0, end=None):
        if end is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return parse(buf, 0, len(buf))
        reader = Reader(buf, end)
        reader.at = start
        rest, tensors, headers = [], {}, []
        while reader.at < reader.end:
            field_start = reader.at
            tag = reader.varint()
            number, wire_type = tag >> 3, tag & 7
            if (number in tensor_fields or number in nested) and wire_type == _LEN:
                n = reader.varint()
                if reader.at + n > reader.end:
                    raise ValueError("packd reply: a tensor runs past the end")
                if number in nested:
                    sub = nested[number](buf, reader.at, reader.at + n)
                    headers.append((number, sub[0]))
                    tensors.setdefault(number, []).append(sub)
                else:
                    header, tensor = _tensor(buf, reader.at, reader.at + n, tensor_type)
                    headers.append((number, header))
                    tensors.setdefault(number, []).append(tensor)
                reader.at += n
                continue
            reader.skip(wire_type)
            rest.append(buf[field_start:reader.at])
        message = message_type.FromString(b"".join(rest))
        for number, header in headers:
            field = descriptor.fields_by_number[number]
            if is_repeated(field):
                getattr(message, field.name).add().CopyFrom(header)
            else:
                getattr(message, field.name).MergeFrom(header)
        return message, tensors

    return parse


def is_repeated(field):
    """Whether a field descriptor is a repeated field: `is_repeated` where the runtime has it
    (newer ones; 7.x removed `label`), else `label`, all that 4.21 (the oldest supported) has."""
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return repeated
    return field.label == field.LABEL_REPEATED


def message_type_of(message_type, field):
    """The generated class of a message field's type."""
    value = getattr(message_type(), field.name)
    return type(value.add() if is_repeated(field) else value)
