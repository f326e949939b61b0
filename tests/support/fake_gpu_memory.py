"""Device memory of packd's fake GPU (tests/fake_gpu) for the Python client's tests: the client's
DeviceMemory seam (packd/_device.py) served by libpackd_fake_gpu_c.so, whose memory is memfd
that a packd_testing server run with --fake_gpu_devices opens from the IPC handles exported here,
as packd opens a CUDA allocation. Fake device memory is host memory, so the tests read it as
ordinary CPU tensors; the client tells it apart by address.

    gpu = FakeGpuMemory(os.environ["PACKD_FAKE_GPU_LIB"], devices=2, physical=[1, 0])
    x = gpu.put(torch.randn(4, 16, 8), 0)          # on fake cuda:0
    client = packd.Client(address, device_memory=gpu)
"""
import ctypes
import threading
import weakref

import torch

from packd._device import Allocation, DeviceMemory, canonical_uuid


class FakeGpuMemory(DeviceMemory):
    def __init__(self, library, devices=1, physical=(), memory_bytes=1 << 30):
        self._lib = ctypes.CDLL(library)
        self._lib.packd_fake_gpu_malloc.argtypes = [ctypes.c_int, ctypes.c_size_t,
                                                    ctypes.POINTER(ctypes.c_void_p)]
        self._lib.packd_fake_gpu_free.argtypes = [ctypes.c_void_p]
        self._lib.packd_fake_gpu_ipc_handle.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._lib.packd_fake_gpu_address_range.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_int)]
        self._lib.packd_fake_gpu_uuid.argtypes = [ctypes.c_int, ctypes.c_char_p]
        order = (ctypes.c_int * max(len(physical), 1))(*physical)
        self._lib.packd_fake_gpu_configure(devices, order, len(physical),
                                           ctypes.c_size_t(memory_bytes))
        self._lock = threading.Lock()
        self._watchers = {}  # allocation base -> callbacks for when it is freed
        self.live = 0        # allocations not yet freed
        self.synchronized = 0

    # -- memory the tests make --------------------------------------------------------------

    def empty(self, shape, dtype, index):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        p = ctypes.c_void_p()
        err = self._lib.packd_fake_gpu_malloc(index, max(nbytes, 1), ctypes.byref(p))
        if err:
            raise MemoryError("fake GPU allocation of %d bytes failed (error %d)" % (nbytes, err))
        buf = (ctypes.c_char * max(nbytes, 1)).from_address(p.value)
        with self._lock:
            self.live += 1
        # Freed when the last tensor over it goes (torch.frombuffer keeps the buffer).
        weakref.finalize(buf, self._free, p.value)
        flat = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
        return flat.view(dtype).reshape(shape)

    def put(self, t, index):
        """A copy of host tensor `t` in fake device memory of `index`."""
        out = self.empty(t.shape, t.dtype, index)
        out.copy_(t)
        return out

    def _free(self, base):
        with self._lock:
            self.live -= 1
            watchers = self._watchers.pop(base, [])
        self._lib.packd_fake_gpu_free(ctypes.c_void_p(base))
        for freed in watchers:
            freed()

    # -- the DeviceMemory seam ---------------------------------------------------------------

    def _range(self, t):
        base, size, device = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_int()
        if t.data_ptr() == 0 or self._lib.packd_fake_gpu_address_range(
                ctypes.c_void_p(t.data_ptr()), ctypes.byref(base), ctypes.byref(size),
                ctypes.byref(device)):
            return None
        return base.value, size.value, device.value

    def device_of(self, t):
        found = self._range(t)
        return None if found is None else found[2]

    def name(self, index):
        return "cuda:%d" % index

    def uuid(self, index):
        raw = ctypes.create_string_buffer(16)
        self._lib.packd_fake_gpu_uuid(index, raw)
        h = raw.raw.hex()
        return canonical_uuid("%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:]))

    def allocation(self, t):
        base, size, _ = self._range(t)
        handle = ctypes.create_string_buffer(64)
        err = self._lib.packd_fake_gpu_ipc_handle(ctypes.c_void_p(base), handle)
        if err:
            raise RuntimeError("fake GPU IPC handle failed (error %d)" % err)
        return Allocation(base, size, handle.raw)

    def to_device(self, t, index):
        return self.put(t, index)

    def synchronize(self, index):
        self.synchronized += 1  # fake device memory is written when the call returns

    def watch(self, allocation, index, freed):
        with self._lock:
            self._watchers.setdefault(allocation.base, []).append(freed)
