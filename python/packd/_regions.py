"""A Client's regions: the pool of shared-memory scratch segments its host calls travel
through, the device regions it registered for GPU tensors, and the one rule for both: a call
the server answers NOT_FOUND (a lease ran out, the server restarted) registers again the
regions it names, then runs once more.

Safe to share across threads: every call gets a segment of its own (the smallest idle one that
holds it, or a new one), and the pool and the device regions are changed only under the lock,
which is never held across an RPC."""
import concurrent.futures
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import grpc
import numpy
import torch

from packd import _tensors, _wire
from packd._connection import Connection, PackdError, is_node_local
from packd._shm import Segment
from packd.options import SharedMemoryOptions
from packd.v1 import pack_service_pb2 as pb

_COPY_PIECE = 4 << 20
_copiers = None
_copiers_lock = threading.Lock()


def copy(dst: numpy.ndarray, src: numpy.ndarray) -> None:
    """dst[:] = src (numpy uint8 arrays): numpy's copy of bytes runs at memcpy's speed (torch's
    uint8 copy_ at half), and a large one is split over a few threads (numpy lets go of the GIL
    while it copies), which a single thread's memory bandwidth does not saturate."""
    global _copiers
    pieces = min(4, os.cpu_count() or 1, src.size // _COPY_PIECE)
    if pieces <= 1:
        numpy.copyto(dst, src)
        return
    with _copiers_lock:
        if _copiers is None:
            _copiers = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1) - 1, thread_name_prefix="packd-copy")
    bounds = [src.size * k // pieces for k in range(pieces + 1)]
    futures = [_copiers.submit(numpy.copyto, dst[a:b], src[a:b])
               for a, b in zip(bounds[1:-1], bounds[2:])]
    numpy.copyto(dst[:bounds[1]], src[:bounds[1]])
    for f in futures:
        f.result()


class Regions:
    def __init__(self, connection: Connection, options: SharedMemoryOptions) -> None:
        self._connection = connection
        self.shm_threshold_bytes = options.threshold_bytes
        self.shm_key_prefix = options.key_prefix
        self.lease_seconds = options.lease_seconds
        self.idle_scratch_segments = options.idle_segments
        # Guards what follows: the scratch segments no call holds, whether the server allows
        # shared memory, whether the client is closed, and the device regions registered (by
        # name: their requests, to register again).
        self._lock = threading.Lock()
        self.idle: List[Segment] = []
        self._shm_allowed: Optional[bool] = None
        self._closed = False
        self._device: Dict[str, pb.RegisterDeviceRegionRequest] = {}

    # -- shared-memory scratch ------------------------------------------------------------

    def scratch_for(self, nbytes: int) -> Optional[Segment]:
        """The scratch segment of a call whose tensors hold `nbytes`, lent to it alone until
        give_back: None when they travel inline, else the smallest idle one that holds them, or
        a new one."""
        if (self.shm_threshold_bytes <= 0 or nbytes < self.shm_threshold_bytes
                or not is_node_local(self._connection.address)):
            return None
        with self._lock:
            allowed = self._shm_allowed
        if allowed is None:
            conn = self._connection
            info = conn.call(conn.stub.GetServerInfo, pb.GetServerInfoRequest())
            allowed = info.shared_memory_enabled
            with self._lock:
                self._shm_allowed = allowed
                # The prefix this caller's keys must carry (its tenant's); an older server
                # says nothing, and the option stands.
                if info.shm_key_prefix:
                    self.shm_key_prefix = info.shm_key_prefix
        if not allowed:
            return None
        with self._lock:
            fits = [seg for seg in self.idle if seg.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda seg: seg.size)
                self.idle.remove(seg)
                seg.reset()
                return seg
        # Rounded up so that slightly larger batches reuse it (the C++ client's rule too).
        return Segment(self._connection, nbytes + nbytes // 4 + (1 << 20), self.shm_key_prefix,
                       self.lease_seconds)

    def give_back(self, scratch: Optional[Segment]) -> None:
        """Returns a call's scratch segment to the idle ones, closing the smallest beyond
        idle_scratch_segments (or it, once closed)."""
        if scratch is None:
            return
        evicted = None
        with self._lock:
            if self._closed:
                evicted = scratch
            else:
                self.idle.append(scratch)
                if len(self.idle) > max(self.idle_scratch_segments, 0):
                    evicted = min(self.idle, key=lambda seg: seg.size)
                    self.idle.remove(evicted)
        if evicted is not None:
            evicted.close()

    @staticmethod
    def encode(t: Any, number: int, outgoing: _wire.Outgoing, scratch: Optional[Segment]) -> None:
        """Adds `t` as tensor field `number`: a handle into `scratch` when given, else its bytes
        (sent from the tensor's own memory)."""
        header = pb.Tensor()
        _tensors.header(t, header)
        src = _tensors.as_bytes_view(t)
        if scratch is not None and t.numel() > 0:
            got = scratch.allocate(src.numel())
            if got is not None:
                offset, dst = got
                copy(dst.numpy(), src.numpy())
                header.region.CopyFrom(scratch.slice(offset, src.numel()))
                outgoing.add(number, header)
                return
        outgoing.add(number, header, memoryview(src.numpy()))

    @staticmethod
    def decode(msg: pb.Tensor, tensor: Any, scratch: Optional[Segment]) -> Any:
        """A result tensor: copied out of `scratch` when packd wrote it there (at memcpy speed,
        so that the segment can be lent again at once), else the inline one."""
        if msg.HasField("region"):
            dtype = _tensors.FROM_WIRE[msg.dtype]
            raw = torch.empty(msg.region.byte_size, dtype=torch.uint8)
            if raw.numel() > 0:
                copy(raw.numpy(), scratch.view(msg.region.offset, msg.region.byte_size).numpy())
            return raw.view(dtype).reshape(list(msg.shape))
        return tensor

    @staticmethod
    def request_in(scratch: Optional[Segment], make: Callable[[], Any],
                   output_sizes: Optional[Iterable[int]]) -> Any:
        """make()'s request (an Outgoing), its tensors encoded into `scratch` from its start,
        with results into slices of it of `output_sizes` bytes each when given and all fit
        (else the results come inline)."""
        if scratch is not None:
            scratch.reset()
        out = make()
        if output_sizes is not None:
            Regions.outputs(scratch, output_sizes, out.message.outputs)
        return out

    @staticmethod
    def outputs(scratch: Optional[Segment], sizes: Iterable[int], outputs: Any) -> None:
        """Slices of `scratch` for results of `sizes` bytes, added to `outputs` when all fit
        (else none: the results come inline)."""
        if scratch is None:
            return
        slices = []
        for n in sizes:
            got = scratch.allocate(n) if n > 0 else None
            if got is None:
                return
            slices.append(scratch.slice(got[0], n))
        outputs.extend(slices)

    # -- device regions -------------------------------------------------------------------

    def register_device(self, request: pb.RegisterDeviceRegionRequest) -> None:
        """Registers a device region (retried as every call is), and keeps its request to
        register it again."""
        conn = self._connection
        conn.call(conn.stub.RegisterDeviceRegion, request)
        self.keep_device(request)

    def keep_device(self, request: pb.RegisterDeviceRegionRequest) -> None:
        with self._lock:
            self._device[request.name] = request

    def forget_device(self, names: Optional[Iterable[str]] = None) -> List[str]:
        """Forgets device regions `names` (None: all of them); the names it knew."""
        with self._lock:
            if names is None:
                names = list(self._device)
            return [name for name in names if self._device.pop(name, None) is not None]

    def device_names(self) -> List[str]:
        with self._lock:
            return list(self._device)

    # -- NOT_FOUND: register again --------------------------------------------------------

    def with_regions(self, call: Callable[[], Any], scratch: Optional[Segment],
                     regions: Sequence[str] = ()) -> Any:
        """call(), and again (up to 3 times in all) while it finds a region gone (NOT_FOUND)
        and registering this call's scratch segment or the device regions it names (`regions`)
        again helps, or a device region it named was unregistered by this client meanwhile
        (unregister_gpu_regions from another thread: call() registers that memory afresh)."""
        for attempt in range(3):
            try:
                return call()
            except PackdError as e:
                if (attempt == 2 or e.code != grpc.StatusCode.NOT_FOUND
                        or not self._reregister(scratch, regions)):
                    raise
        raise AssertionError("unreachable")

    def _reregister(self, scratch, regions=()):
        """Registers again what the server no longer holds (a lease ran out, or the server
        restarted) of `scratch` (the call's own segment, which no other call uses) and of the
        device regions `regions`; how many. Registering device memory twice is harmless: the
        server takes a repeated registration as the one it holds."""
        conn = self._connection
        known = {r.name for r in conn.call(conn.stub.ListRegions,
                                           pb.ListRegionsRequest()).regions}
        count = 0
        if scratch is not None and scratch.region not in known:
            scratch.renew()
            count += 1
        with self._lock:
            devices = [self._device[name] for name in set(regions)
                       if name not in known and name in self._device]
            forgotten = [name for name in set(regions) if name not in self._device]
        for request in devices:
            conn.call(conn.stub.RegisterDeviceRegion, request)
            count += 1
        return count + len(forgotten)

    def close(self) -> None:
        """Unregisters the idle scratch segments (those of calls still running go when they
        end)."""
        with self._lock:
            self._closed = True
            idle, self.idle = self.idle, []
        for seg in idle:
            seg.close()
