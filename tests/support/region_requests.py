"""A PackRequest whose one input is named by a region (a slice of registered memory) rather than
sent: what the device-region tests build by hand to reach the server past the client.

    request = region_pack_request("uuid:" + uuid, mask, slice_, pb.DTYPE_FLOAT32, [4, 9, 3])
"""
from packd.v1 import pack_service_pb2 as pb


def region_pack_request(device, mask, region, dtype, shape):
    """Pack on `device` of the host bool `mask` ([B, S]) over the input at `region` (a
    RegionSlice), of wire dtype `dtype` and `shape`."""
    request = pb.PackRequest(device=device)
    request.mask.dtype = pb.DTYPE_BOOL
    request.mask.shape.extend(list(mask.shape))
    request.mask.data = mask.numpy().tobytes()
    t = request.inputs.add()
    t.dtype = dtype
    t.shape.extend(shape)
    t.region.CopyFrom(region)
    return request
