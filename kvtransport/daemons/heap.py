"""A daemon faults in memory at start-up and keeps it, with the memory of finished
transfers, for the buffers of the next transfers (glibc's malloc).

A transfer's output buffer is one allocation the size of its payload (tens to hundreds of
MB). glibc serves an allocation above its mmap threshold (32 MB at most) with a fresh
mapping and unmaps it on free, so each such buffer touches fresh pages and pays the kernel
a fault and a page of zeroing per page it writes, in system time, inside the transfer; on
a VM whose host reclaims guest memory that can cost more than the protocol's own work
(docs/results.md, issue 15).

:func:`keep_freed_memory` makes malloc serve every allocation from its heap and keep what
is freed (``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` the largest); :func:`prefault` then
faults in ``nbytes`` and frees them, so that the buffers of the transfers to come reuse
those pages. Measured (docs/results.md), keeping without a prefault is slower than
glibc's defaults: the heap then grows a transfer at a time and faults as much. So the
daemons do both (``--prefault-mb``) or neither. The cost is resident memory: the process
keeps the prefault and its peak from then on. Process-wide, so the daemon commands call
it, never a library embedded in someone else's process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_LARGEST_INT = 2**31 - 1
PAGE = 4096


def _libc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (None elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for later allocations, large ones included;
    True if it took both settings, False where the C library is not glibc (nothing
    changes there)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _LARGEST_INT)
    )


def prefault(nbytes: int) -> None:
    """Touch ``nbytes`` of new memory and free it: after :func:`keep_freed_memory`, the
    next allocations up to that size reuse those pages instead of faulting in fresh
    ones (without it this only costs the time)."""
    if nbytes <= 0:
        return
    buf = np.empty(nbytes, np.uint8)
    buf[::PAGE] = 0  # one write per page faults the page in
    del buf
