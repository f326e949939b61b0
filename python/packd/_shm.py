"""Shared-memory segments registered with packd: tensors travel as handles instead of bytes."""
import atexit
import itertools
import os
import weakref
from multiprocessing import resource_tracker, shared_memory

import torch

from packd.v1 import pack_service_pb2 as pb

_counter = itertools.count()
_live = weakref.WeakSet()


class Segment:
    """One POSIX shared-memory object under the server's key prefix, registered as a region.
    A bump allocator hands out 64-byte aligned slices; reset() frees them all."""

    def __init__(self, client, size, key_prefix="/packd"):
        n = next(_counter)
        base = key_prefix.lstrip("/")
        self.name = f"{base}_py_{os.getpid()}_{n}"
        self.region = f"py-{os.getpid()}-{n}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=size)
        # packd unlinks nothing; this process owns the segment and unlinks it in close().
        try:
            resource_tracker.unregister(self._shm._name, "shared_memory")
        except Exception:  # pragma: no cover - tracker details vary by Python version
            pass
        self.size = size
        self.used = 0
        self._client = client
        self._bytes = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        client._call(client._stub.RegisterSystemRegion, pb.RegisterSystemRegionRequest(
            name=self.region, key="/" + self.name, offset=0, byte_size=size))
        _live.add(self)

    def allocate(self, nbytes):
        """(offset, uint8 view) of `nbytes`, or None when the segment is full."""
        start = (self.used + 63) // 64 * 64
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return start, self._bytes[start:start + nbytes]

    def reset(self):
        self.used = 0

    def slice(self, offset, nbytes):
        return pb.RegionSlice(region=self.region, offset=offset, byte_size=nbytes)

    def view(self, offset, nbytes):
        return self._bytes[offset:offset + nbytes]

    def close(self):
        if self._shm is None:
            return
        try:
            self._client._call(self._client._stub.UnregisterRegion,
                               pb.UnregisterRegionRequest(name=self.region), retries=0)
        except Exception:
            pass  # the server may be gone; the segment is ours to remove all the same
        self._bytes = None
        try:
            self._shm.close()
        except BufferError:
            pass  # tensors still view it; the mapping goes when they do
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._shm = None


@atexit.register
def _close_all():
    for seg in list(_live):
        seg.close()
