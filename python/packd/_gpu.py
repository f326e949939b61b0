"""A Client's GPU path (the counterpart of the C++ client's gpu_calls.cc): a call whose tensors
are all on one GPU registers the allocations holding them as device regions (once each, with
the lease; again when the address holds another allocation), allocates its results on that GPU
and has packd write them there; no tensor byte crosses the host.

Safe to share across threads: the allocations registered are changed only under the lock
(never held across an RPC), and allocations freed are queued without it (their finalizers run
anywhere) and unregistered by the next call."""
import collections
import itertools
import os
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import grpc
import torch

from packd import _device, _requests, _tensors, _wire
from packd._connection import Connection, PackdError
from packd._regions import Regions
from packd.v1 import pack_service_pb2 as pb

# Device regions of GPU tensors are named py-gpu-PID-TAG-N: the tag tells processes of other pid
# namespaces apart.
_GPU_TAG = os.urandom(4).hex()

# A Pack on a GPU whose inputs take at most this many bytes gets outputs with room for every
# row: packd then gathers without a round trip for the count, and the client does not count
# the mask's active positions first (which would wait for the GPU). Larger ones are counted
# and get outputs of their exact size, so that a sparse mask does not hold the dense size.
ROOM_FOR_ALL_BYTES = 64 << 20
_gpu_regions = itertools.count()


def device_slice(storage_offset: int, storage_bytes: int, tensor_offset: int,
                 tensor_bytes: int) -> Tuple[int, int]:
    """The (offset, byte_size) of a tensor in a device region registered from its IPC handle.

    The handle maps the allocation from its start; the tensor's storage begins
    `storage_offset` bytes into the allocation, and the tensor `tensor_offset` bytes into its
    storage. The region must cover storage_offset + storage_bytes."""
    if tensor_offset < 0 or tensor_offset + tensor_bytes > storage_bytes:
        raise ValueError("the tensor (%d bytes at %d) is not inside its storage of %d bytes"
                         % (tensor_bytes, tensor_offset, storage_bytes))
    return storage_offset + tensor_offset, tensor_bytes


class Gpu:
    def __init__(self, connection: Connection, regions: Regions,
                 memory: _device.DeviceMemory, lease_seconds: int) -> None:
        self._connection = connection
        self._regions = regions
        self.memory = memory
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        # The allocations registered: (device, base) -> (region name, handle); and ((device,
        # base) or None, region name) of allocations freed since, to forget and unregister:
        # appended to without the lock, from wherever memory is freed (a finalizer).
        self.allocations = {}
        self._freed = collections.deque()
        self._uuids = {}

    def device_of(self, named: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> Optional[int]:
        """The GPU of a call whose tensors ((name, tensor or None) pairs) are on one GPU; None
        when they are in host memory. ValueError naming two that are on different devices.
        Host tensors without bytes go with any device."""
        where = []
        for name, t in named:
            if t is None:
                continue
            index = self.memory.device_of(t)
            if index is None and t.device.type == "cpu" and t.numel() == 0:
                continue
            where.append((name, index))
        if not where:
            return None
        label = lambda index: "cpu" if index is None else self.memory.name(index)
        first_name, first = where[0]
        for name, index in where[1:]:
            if index != first:
                raise ValueError("%s is on %s but %s is on %s: the tensors of one call must be "
                                 "on one device" % (first_name, label(first), name, label(index)))
        return first

    def uuid(self, index: int) -> str:
        with self._lock:
            known = self._uuids.get(index)
        if known is None:
            known = self.memory.uuid(index)
            with self._lock:
                self._uuids[index] = known
        return known

    def check_device_argument(self, device: str, index: int) -> None:
        if device and device not in (self.memory.name(index), "uuid:" + self.uuid(index)):
            raise ValueError("device=%r names where host tensors run; these tensors are on %s, "
                             "where the call runs" % (device, self.memory.name(index)))

    def to_device_of(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`t` on the GPU that holds `like`, when `t` is not there (a gradient autograd left in
        host memory); `t` itself otherwise."""
        index = self.memory.device_of(like)
        if index is None or self.memory.device_of(t) == index or t.numel() == 0:
            return t
        return self.memory.to_device(t.detach().cpu(), index)

    # -- registrations ----------------------------------------------------------------------

    def slice(self, t: torch.Tensor, index: int, regions: List[str]) -> pb.RegionSlice:
        """The RegionSlice of `t` (contiguous, on GPU `index`, with bytes), its allocation
        registered as a device region first when it is not yet; the region's name is added to
        `regions`."""
        alloc = self.memory.allocation(t)
        key = (index, alloc.base)
        with self._lock:
            known = self.allocations.get(key)
        if known is not None and known[1] != alloc.handle:
            # The address is another allocation's now: the one registered was freed.
            self._forget(key, known[0])
            self.unregister_freed()
            known = None
        if known is None:
            name = "py-gpu-%d-%s-%d" % (os.getpid(), _GPU_TAG, next(_gpu_regions))
            request = pb.RegisterDeviceRegionRequest(
                name=name, ipc_handle=alloc.handle, device=self.memory.name(index),
                device_uuid=self.uuid(index), byte_size=alloc.size,
                lease_seconds=self.lease_seconds)
            conn = self._connection
            conn.call(conn.stub.RegisterDeviceRegion, request)
            with self._lock:
                raced = self.allocations.get(key)
                if raced is not None and raced[1] == alloc.handle:
                    self._freed.append((None, name))  # another call registered it meanwhile
                else:
                    self.allocations[key] = (name, alloc.handle)
                    raced = None
            if raced is None:
                self._regions.keep_device(request)
                self.memory.watch(alloc, index, lambda: self._forget(key, name))
                known = (name, alloc.handle)
            else:
                known = raced
        regions.append(known[0])
        return pb.RegionSlice(region=known[0], offset=t.data_ptr() - alloc.base,
                              byte_size=t.numel() * t.element_size())

    def _forget(self, key, name):
        """Region `name` of allocation `key` is no longer to be used (the allocation was
        freed): forgotten and unregistered by the next call or close. Takes no lock: the device
        memory may say so from a finalizer, in any thread, at any moment."""
        self._freed.append((key, name))

    def unregister_freed(self, everything: bool = False) -> None:
        """Forgets and unregisters the regions of allocations freed since the last call (or
        every device region of the client, with `everything`)."""
        names = []
        with self._lock:
            if everything:
                self._freed.extend((None, name) for name in self._regions.device_names())
                self.allocations.clear()
            while self._freed:
                key, name = self._freed.popleft()
                if key is not None and self.allocations.get(key, (None,))[0] == name:
                    del self.allocations[key]
                if self._regions.forget_device([name]) or key is None:
                    names.append(name)
        conn = self._connection
        for name in names:
            try:
                conn.call(conn.stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name),
                          retries=0)
            except PackdError:
                pass  # gone already (its lease ran out), or the server is away: its lease ends it

    # -- calls ------------------------------------------------------------------------------

    def encoder(self, index: int, regions: List[str]) -> _requests.Encoder:
        """How a call on GPU `index` adds a tensor (contiguous): a slice of its device region,
        or no bytes when it has none; the regions it names go to `regions`."""
        def encode(t: torch.Tensor, number: int, outgoing: _wire.Outgoing) -> None:
            header = pb.Tensor()
            _tensors.header(t, header)
            if t.numel() == 0:
                outgoing.add(number, header, memoryview(b""))
            else:
                header.region.CopyFrom(self.slice(t, index, regions))
                outgoing.add(number, header)
        return encode

    def call(self, index: int, method: Any,
             request: Callable[[_requests.Encoder, str], _wire.Outgoing],
             outputs: Sequence[torch.Tensor]) -> Tuple[Any, dict]:
        """A call on GPU `index`: request(encode, device) builds it with the GPU's encoder and
        name, the results written into `outputs` (GPU tensors; none has no bytes) when given,
        else returned inline. The reply and its inline tensors."""
        self.unregister_freed()
        self.memory.synchronize(index)  # the inputs written, the outputs' memory free
        regions: List[str] = []

        def attempt():
            del regions[:]
            encode = self.encoder(index, regions)
            out = request(encode, "uuid:" + self.uuid(index))
            del out.message.outputs[:]
            out.message.outputs.extend(self.slice(o, index, regions) for o in outputs)
            return self._connection.call(method, out)

        return self._regions.with_regions(attempt, None, regions)

    def step(self, index: int, request: Callable[[_requests.Encoder], _wire.Outgoing],
             arena_bytes: int, start: Callable[..., Any]) -> Tuple[Any, Any, Callable]:
        """A PackMicroBatches call on GPU `index`: request(encode) builds it with the GPU's
        encoder, and start(message, timeout, metadata) makes the call and reads its first
        message. The results go into an arena of `arena_bytes` allocated on the GPU for this
        step (none when 0: inline). Returns the call, its first message and how a result
        tensor is decoded: a view of the arena where packd wrote it (the arena lives as long as
        one of them does), else the inline tensor copied to the GPU."""
        self.unregister_freed()
        arena = (self.memory.empty([arena_bytes], torch.uint8, index) if arena_bytes > 0
                 else None)
        # The inputs written, and the arena's memory free of the stream's earlier work: packd
        # writes it outside the stream's order.
        self.memory.synchronize(index)
        regions: List[str] = []
        at = [0]

        def attempt():
            del regions[:]
            out = request(self.encoder(index, regions))
            if arena is not None:
                outputs = self.slice(arena, index, regions)
                at[0] = outputs.offset
                out.message.outputs.CopyFrom(outputs)
            return self._connection.call(start, out)

        call, first = self._regions.with_regions(attempt, None, regions)

        def decode(msg: pb.Tensor, tensor: Any) -> torch.Tensor:
            if not msg.HasField("region"):
                return self.memory.to_device(tensor, index)
            dtype = _tensors.FROM_WIRE[msg.dtype]
            if msg.region.byte_size == 0 or arena is None:
                return self.memory.empty(list(msg.shape), dtype, index)
            begin = msg.region.offset - at[0]
            if begin < 0 or begin + msg.region.byte_size > arena.numel():
                raise PackdError(grpc.StatusCode.INTERNAL,
                                 "packd wrote a result at %d..%d, outside the step's arena of "
                                 "%d bytes" % (begin, begin + msg.region.byte_size,
                                               arena.numel()))
            return (arena[begin:begin + msg.region.byte_size].view(dtype)
                    .reshape(list(msg.shape)))

        return call, first, decode

    def outputs(self, shapes: Sequence[Tuple[Sequence[int], torch.dtype]],
                index: int) -> List[torch.Tensor]:
        """Result memory on GPU `index`, one tensor per (shape, dtype); none at all when one
        would have no bytes (results then come inline: a slice of none names no memory)."""
        if any(torch.Size(shape).numel() == 0 for shape, _ in shapes):
            return []
        return [self.memory.empty(shape, dtype, index) for shape, dtype in shapes]

    def results(self, messages: Sequence[pb.Tensor], inline: Sequence[torch.Tensor],
                outputs: Sequence[torch.Tensor], index: int) -> List[torch.Tensor]:
        """The result tensors on GPU `index`: `outputs` where packd wrote them (checked against
        the reply's shapes), else the inline ones copied there."""
        if not outputs:
            return [self.memory.to_device(t, index) for t in inline]
        for m, o in zip(messages, outputs):
            if not m.HasField("region") or list(m.shape) != list(o.shape):
                raise PackdError(grpc.StatusCode.INTERNAL,
                                 "packd answered shape %s for a result of shape %s"
                                 % (list(m.shape), list(o.shape)))
        return list(outputs)

    def pack(self, index, tensors, mask, segment_ids, with_position_ids, layout):
        """The PackResponse, packed and shifted tensors of a Pack on GPU `index`, written by
        packd into tensors allocated there (a layout's results come inline and are copied
        there)."""
        mask, tensors, segment_ids = _contiguous(mask, tensors, segment_ids)
        outputs, room = [], False
        if mask.dim() == 2 and all(t.dim() >= 2 for t in tensors) and not layout.any():
            room = sum(t.numel() * t.element_size() for t in tensors) <= ROOM_FOR_ALL_BYTES
            if room:
                # Room for every row: packd writes the packed rows without asking the GPU
                # how many first, and neither side waits for the count (docs/gpu.md).
                rows = mask.numel()
            else:
                rows = int(torch.count_nonzero(mask))
            outputs = self.outputs([([rows] + list(t.shape[2:]), t.dtype) for t in tensors],
                                   index)
        reply, inline = self.call(index, self._connection.pack[0], lambda encode, device: (
            _requests.pack_request(encode, device, with_position_ids, layout, mask, tensors,
                                   segment_ids)), outputs)
        if room and outputs:
            outputs = [o[:reply.total_active] for o in outputs]
        field = pb.PackResponse
        return (reply,
                self.results(reply.packed, inline.get(field.PACKED_FIELD_NUMBER, []), outputs,
                             index),
                self.results(reply.shifted, inline.get(field.SHIFTED_FIELD_NUMBER, []), [],
                             index))

    def scatter(self, index, tensors, mask, tail_shape, segment_ids, layout):
        """The dense tensors of a Scatter on GPU `index`, written by packd into tensors
        allocated there."""
        mask, tensors, segment_ids = _contiguous(mask, tensors, segment_ids)
        outputs = []
        if mask.dim() == 2 and all(t.dim() >= 1 for t in tensors):
            outputs = self.outputs([(list(mask.shape) + list(t.shape[1:]), t.dtype)
                                    for t in tensors], index)
        reply, inline = self.call(index, self._connection.scatter[0], lambda encode, device: (
            _requests.scatter_request(encode, device, layout, tail_shape, mask, tensors,
                                      segment_ids)), outputs)
        return self.results(reply.dense,
                            inline.get(pb.ScatterResponse.DENSE_FIELD_NUMBER, []), outputs,
                            index)


def _contiguous(mask, tensors, segment_ids):
    """A call's mask, tensors and segment ids (or None), each contiguous."""
    return (mask.contiguous(), [t.contiguous() for t in tensors],
            None if segment_ids is None else segment_ids.contiguous())
