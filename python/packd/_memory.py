"""Keeping freed memory mapped: glibc malloc returns large freed blocks to the kernel at once, so
every large call's buffers (the request joined for gRPC, gRPC's own copies, the reply) are fresh
memory, a page fault per 4 KiB page: for a 128 MiB call that costs more than the copies
themselves. keep_freed_memory() serves large blocks from the heap instead and lets the process
keep up to 1 GiB of freed heap (the same tuning as packd's --keep_freed_memory). A no-op where
the C library is not glibc."""
import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done = False


def keep_freed_memory():
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass
