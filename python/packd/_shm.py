"""Shared-memory segments registered with packd: tensors travel as handles instead of bytes."""
import atexit
import itertools
import os
import weakref
from multiprocessing import resource_tracker, shared_memory

import _posixshmem

import torch

from packd.v1 import pack_service_pb2 as pb

_counter = itertools.count()
# Apart from the pid, names carry a random tag: processes of other pid namespaces may share
# /dev/shm and the server.
_TAG = os.urandom(4).hex()
_live = weakref.WeakSet()


class Segment:
    """One POSIX shared-memory object under the server's key prefix, registered as a region
    with a lease. A bump allocator hands out 64-byte aligned slices; reset() frees them all.

    The object's name is removed as soon as the server has mapped it: the memory lives while
    this process or the server's lease holds it, and nothing is left in /dev/shm however the
    process ends."""

    def __init__(self, connection, size, key_prefix="/packd", lease_seconds=30):
        n = next(_counter)
        self._base = f"{key_prefix.lstrip('/')}_py_{os.getpid()}_{_TAG}_{n}"
        self._generation = itertools.count()
        self.region = f"py-{os.getpid()}-{_TAG}-{n}"
        self.size = size
        self.lease_seconds = lease_seconds
        self._connection = connection
        self._shm = None
        self._create()
        _live.add(self)

    def _create(self):
        """Maps a fresh object, registers it as this segment's region and unlinks its name."""
        name = f"{self._base}_{next(self._generation)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=self.size)
        # The name is unlinked below, by this process: the tracker has nothing to clean up.
        try:
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:  # pragma: no cover - tracker details vary by Python version
            pass
        try:
            self._connection.call(self._connection.stub.RegisterSystemRegion,
                                  pb.RegisterSystemRegionRequest(
                                      name=self.region, key="/" + name, offset=0,
                                      byte_size=self.size, lease_seconds=self.lease_seconds))
        except BaseException:
            shm.close()
            raise
        finally:
            _posixshmem.shm_unlink(shm._name)
        self._release()
        self._shm = shm
        self.name = name
        self._bytes = torch.frombuffer(shm.buf, dtype=torch.uint8)
        self.used = 0

    def renew(self):
        """Registers the region again (the server dropped it: its lease ran out, or it
        restarted) on fresh memory; what was allocated is gone."""
        self._create()

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

    def _release(self):
        self._bytes = None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                pass  # tensors still view it; the mapping goes when they do
        self._shm = None

    def close(self):
        if self._shm is None:
            return
        try:
            self._connection.call(self._connection.stub.UnregisterRegion,
                                  pb.UnregisterRegionRequest(name=self.region), retries=0)
        except Exception:
            pass  # the server may be gone, and its lease will end the region
        self._release()


@atexit.register
def _close_all():
    for seg in list(_live):
        seg.close()
