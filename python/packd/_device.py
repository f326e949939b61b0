"""GPU memory for the client: which tensors live on a GPU, the allocation that holds each, and
memory for results on the same GPU.

A call whose tensors are on a GPU keeps them there: the client registers the allocations that
hold them as device regions (packd opens them from their IPC handles), allocates the results on
the same GPU, registers those, and sends slices. `DeviceMemory` is the seam between the client
and the GPU runtime: `TorchCuda` (the default) serves torch's CUDA tensors; tests give the client
memory of packd's fake GPU instead (tests/support/fake_gpu_memory.py).
"""
import ctypes
import ctypes.util
from typing import NamedTuple, Optional

import torch


class Allocation(NamedTuple):
    """The allocation a tensor's bytes lie in: an IPC handle maps it whole, from its start."""
    base: int     # its first byte's address
    size: int     # bytes
    handle: bytes  # 64-byte IPC handle exporting it


class DeviceMemory:
    """What the client needs of a GPU runtime. Devices are this process's indices."""

    def device_of(self, t: torch.Tensor) -> Optional[int]:
        """The index of the GPU holding `t`, or None for host memory."""
        raise NotImplementedError

    def name(self, index: int) -> str:
        """The device as error messages name it: "cuda:0"."""
        raise NotImplementedError

    def uuid(self, index: int) -> str:
        """"GPU-8f3c...": the device's name in every process, whatever its index there."""
        raise NotImplementedError

    def allocation(self, t: torch.Tensor) -> Allocation:
        """The allocation holding `t`'s bytes (t has at least one)."""
        raise NotImplementedError

    def empty(self, shape, dtype, index: int) -> torch.Tensor:
        """An uninitialised tensor on GPU `index`."""
        raise NotImplementedError

    def to_device(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """A host tensor's copy on GPU `index` (the small results: cu_seqlens and the like)."""
        raise NotImplementedError

    def synchronize(self, index: int):
        """Returns once the work queued on GPU `index` so far has finished: the inputs are
        written and the results' memory is free before packd, another process, touches them."""
        raise NotImplementedError

    def watch(self, allocation: Allocation, index: int, freed) -> None:
        """Calls freed() once the allocation is freed, where the runtime can tell (optional)."""


def canonical_uuid(text: str) -> str:
    """A UUID as packd lists them: "GPU-" and lowercase hex (the server takes any case)."""
    text = text.strip().lower()
    return "GPU-" + (text[4:] if text.startswith("gpu-") else text)


class _Driver:
    """The two CUDA driver calls torch does not expose: the allocation holding an address
    (cuMemGetAddressRange) and its IPC handle (cuIpcGetMemHandle). Driver calls need a current
    context on the calling thread, which a thread that has made no CUDA runtime call lacks
    (torch.cuda.device(i) sets none when i is already the thread's device): the device's
    primary context, the one torch's runtime uses, is retained once and made current then."""

    def __init__(self):
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise RuntimeError("packd: CUDA tensors need the CUDA driver (%s): %s"
                               % (name, e)) from None
        self._range = lib.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self._handle = lib.cuIpcGetMemHandle
        self._handle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self._get_current = lib.cuCtxGetCurrent
        self._get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._set_current = lib.cuCtxSetCurrent
        self._set_current.argtypes = [ctypes.c_void_p]
        self._device_get = lib.cuDeviceGet
        self._device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._retain = lib.cuDevicePrimaryCtxRetain
        self._retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._primary = {}  # ordinal -> its primary context, retained for the process's life

    def _check(self, err, what):
        if err:
            raise RuntimeError("packd: %s failed (CUresult %d)" % (what, err))

    def ensure_context(self, ordinal):
        """Makes a context current on this thread when none is: device `ordinal`'s primary."""
        current = ctypes.c_void_p()
        self._check(self._get_current(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        context = self._primary.get(ordinal)
        if context is None:
            device = ctypes.c_int()
            self._check(self._device_get(ctypes.byref(device), ordinal), "cuDeviceGet")
            context = ctypes.c_void_p()
            self._check(self._retain(ctypes.byref(context), device.value),
                        "cuDevicePrimaryCtxRetain")
            self._primary[ordinal] = context
        self._check(self._set_current(context), "cuCtxSetCurrent")

    def allocation(self, address):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        err = self._range(ctypes.byref(base), ctypes.byref(size), address)
        if err:
            raise RuntimeError("packd: cuMemGetAddressRange failed (CUresult %d)" % err)
        handle = ctypes.create_string_buffer(64)
        err = self._handle(handle, base.value)
        if err:
            raise RuntimeError("packd: cuIpcGetMemHandle failed (CUresult %d): memory from "
                               "cudaMallocAsync or expandable segments cannot be exported; "
                               "use torch's default caching allocator" % err)
        return Allocation(base.value, size.value, handle.raw)


class TorchCuda(DeviceMemory):
    """torch's CUDA tensors. The caching allocator gives no word when it frees an allocation,
    so a region of freed memory goes when the address comes back as another allocation (its
    IPC handle differs), when its lease runs out, or when the client closes."""

    def __init__(self):
        self._driver = None

    def device_of(self, t):
        return t.device.index if t.is_cuda else None

    def name(self, index):
        return "cuda:%d" % index

    def uuid(self, index):
        return canonical_uuid(str(torch.cuda.get_device_properties(index).uuid))

    def allocation(self, t):
        if self._driver is None:
            self._driver = _Driver()
        with torch.cuda.device(t.device.index):
            self._driver.ensure_context(t.device.index)
            return self._driver.allocation(t.data_ptr())

    def empty(self, shape, dtype, index):
        return torch.empty(shape, dtype=dtype, device=self.name(index))

    def to_device(self, t, index):
        return t.to(self.name(index))

    def synchronize(self, index):
        torch.cuda.current_stream(index).synchronize()
