"""Tensors to and from the wire: C-contiguous little-endian bytes of one of the ten dtypes."""
import torch

from packd.v1 import pack_service_pb2 as pb

TO_WIRE = {
    torch.bool: pb.DTYPE_BOOL, torch.uint8: pb.DTYPE_UINT8, torch.int8: pb.DTYPE_INT8,
    torch.int16: pb.DTYPE_INT16, torch.int32: pb.DTYPE_INT32, torch.int64: pb.DTYPE_INT64,
    torch.float16: pb.DTYPE_FLOAT16, torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float32: pb.DTYPE_FLOAT32, torch.float64: pb.DTYPE_FLOAT64,
}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}


def wire_dtype(t):
    try:
        return TO_WIRE[t.dtype]
    except KeyError:
        raise ValueError(f"dtype {t.dtype} is not one packd carries: use one of "
                         f"{', '.join(str(d) for d in TO_WIRE)}") from None


def as_bytes_view(t):
    """A flat uint8 view of a CPU tensor's bytes (contiguous first; no copy when it already is)."""
    if t.device.type != "cpu":
        raise ValueError(f"tensors must be in host memory, not on {t.device}")
    # Flat first: an empty or size-1 dimension may keep any stride (an expanded gradient of an
    # empty tensor has stride 0, and .contiguous() leaves it so), and viewing as bytes needs 1.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def header(t, msg):
    msg.dtype = wire_dtype(t)
    msg.shape.extend(t.shape)
