"""Whether this machine lets one process open another's GPU memory by CUDA IPC, which packd's
device regions need: a child process allocates 1 MiB on GPU 0, writes a pattern and exports it
(cuIpcGetMemHandle); this process opens the handle (cuIpcOpenMemHandle), reads it back and compares.
The driver is called through ctypes (libcuda.so.1): no torch, a second or two.

    python3 tests/gpu/ipc_preflight.py      # exit 0: IPC works; 2: refused; 3: no usable GPU

run_gpu_checks.sh runs it first: a machine (a container without the IPC namespace, a driver or
MIG setting) that refuses CUDA IPC is reported as that, with the driver's error, not as a packd
mismatch. With PACKD_FAKE_GPU_LIB naming libpackd_fake_gpu_c.so the same steps run on packd's fake
GPU (tests/gpu/rehearse.sh), where PACKD_GPU_CHECK_PLANT="preflight:refuse" has this process open
a handle it exported itself, which CUDA (and the fake) refuse: the refusal's path, rehearsed.
"""
import ctypes
import os
import random
import select
import subprocess
import sys
import time

SIZE = 1 << 20
TIMEOUT_S = 10.0


class DriverError(Exception):
    pass


class CudaDriver:
    """The CUDA driver API on device 0, its primary context current."""

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    def __init__(self):
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DriverError("no CUDA driver (libcuda.so.1): %s" % e) from None
        self._call("cuInit", 0)
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self._call("cuDeviceGet", ctypes.byref(device), 0)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        self._call("cuCtxSetCurrent", context)

    def _call(self, name, *args):
        err = getattr(self._lib, name)(*args)
        if err:
            text, label = ctypes.c_char_p(), ctypes.c_char_p()
            self._lib.cuGetErrorName(err, ctypes.byref(label))
            self._lib.cuGetErrorString(err, ctypes.byref(text))
            raise DriverError("%s: %s (%d): %s" % (name, (label.value or b"?").decode(), err,
                                                   (text.value or b"?").decode()))

    def alloc(self, n):
        p = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(n))
        return p.value

    def write(self, p, data):
        self._call("cuMemcpyHtoD_v2", ctypes.c_uint64(p), data, ctypes.c_size_t(len(data)))

    def read(self, p, n):
        out = ctypes.create_string_buffer(n)
        self._call("cuMemcpyDtoH_v2", out, ctypes.c_uint64(p), ctypes.c_size_t(n))
        return out.raw

    def export(self, p):
        handle = self.Handle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(p))
        return bytes(handle)

    def open(self, handle):
        p = ctypes.c_uint64()
        self._call("cuIpcOpenMemHandle_v2", ctypes.byref(p), self.Handle.from_buffer_copy(handle),
                   ctypes.c_uint(1))  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return p.value

    def close(self, p):
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(p))


class FakeDriver:
    """packd's fake GPU (libpackd_fake_gpu_c.so): its device memory is host memory."""

    def __init__(self, library):
        self._lib = ctypes.CDLL(library)
        self._lib.packd_fake_gpu_malloc.argtypes = [ctypes.c_int, ctypes.c_size_t,
                                                    ctypes.POINTER(ctypes.c_void_p)]
        self._lib.packd_fake_gpu_ipc_handle.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._lib.packd_fake_gpu_ipc_open.argtypes = [ctypes.c_char_p,
                                                      ctypes.POINTER(ctypes.c_void_p)]
        self._lib.packd_fake_gpu_ipc_close.argtypes = [ctypes.c_void_p]
        self._lib.packd_fake_gpu_error_string.restype = ctypes.c_char_p
        self._lib.packd_fake_gpu_configure(1, (ctypes.c_int * 1)(0), 0, ctypes.c_size_t(1 << 26))

    def _check(self, name, err):
        if err:
            raise DriverError("%s: error %d: %s" % (
                name, err, self._lib.packd_fake_gpu_error_string(err).decode()))

    def alloc(self, n):
        p = ctypes.c_void_p()
        self._check("malloc", self._lib.packd_fake_gpu_malloc(0, n, ctypes.byref(p)))
        return p.value

    def write(self, p, data):
        ctypes.memmove(p, data, len(data))

    def read(self, p, n):
        return ctypes.string_at(p, n)

    def export(self, p):
        out = ctypes.create_string_buffer(64)
        self._check("IpcGetMemHandle", self._lib.packd_fake_gpu_ipc_handle(p, out))
        return out.raw

    def open(self, handle):
        p = ctypes.c_void_p()
        self._check("IpcOpenMemHandle", self._lib.packd_fake_gpu_ipc_open(handle, ctypes.byref(p)))
        return p.value

    def close(self, p):
        self._check("IpcCloseMemHandle", self._lib.packd_fake_gpu_ipc_close(p))


def driver():
    library = os.environ.get("PACKD_FAKE_GPU_LIB")
    return FakeDriver(library) if library else CudaDriver()


def pattern(seed):
    return random.Random(seed).randbytes(SIZE)


def child():
    """Allocates, writes the pattern of the seed on argv, exports, and holds the memory until
    its standard input gives a line."""
    try:
        d = driver()
        p = d.alloc(SIZE)
        d.write(p, pattern(int(sys.argv[2])))
        print("handle", d.export(p).hex(), flush=True)
    except DriverError as e:
        print("error", e, flush=True)
        return 3
    sys.stdin.readline()
    return 0


def main():
    start = time.monotonic()
    seed = random.randrange(1 << 30)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(seed)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
        line = proc.stdout.readline().split(None, 1) if ready else []
        if not line:
            print("preflight: no usable GPU: the exporting child said nothing in %.0f s (exit %s)"
                  % (TIMEOUT_S, proc.poll()))
            return 3
        if line[0] == "error":
            print("preflight: no usable GPU: the exporting child: %s" % line[1].strip())
            return 3
        handle = bytes.fromhex(line[1].strip())
        try:
            d = driver()
            if "preflight:refuse" in os.environ.get("PACKD_GPU_CHECK_PLANT", "").split(","):
                handle = d.export(d.alloc(SIZE))  # our own: refused
        except DriverError as e:
            print("preflight: no usable GPU: %s" % e)
            return 3
        try:
            p = d.open(handle)
        except DriverError as e:
            print("preflight: this machine refuses CUDA IPC: %s" % e)
            return 2
        try:
            same = d.read(p, SIZE) == pattern(seed)
        finally:
            d.close(p)
        if not same:
            print("preflight: this machine refuses CUDA IPC: the opened memory does not hold "
                  "what the child wrote")
            return 2
        print("preflight: CUDA IPC works (a child's 1 MiB opened and read back, %.1f s)"
              % (time.monotonic() - start))
        return 0
    finally:
        if proc.poll() is None:
            try:
                proc.stdin.write("\n")
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


if __name__ == "__main__":
    sys.exit(child() if sys.argv[1:2] == ["--child"] else main())
