"""Giving memory the allocator keeps back to the OS between calibration phases.

glibc's malloc keeps freed memory in its arenas for reuse, and a phase that frees many mid-sized buffers
(a layer's fp32 temporaries, a GPTQ chunk) leaves them resident: measured on the GPTQ memory benchmark,
more than half of the peak above the runtime baseline was such retained free memory (docs/benchmarks.md,
"GPTQ memory"). `release_free_memory` calls glibc's `malloc_trim(0)` at phase boundaries, which returns
every free page of every arena; it costs a few milliseconds, unlike a global mmap threshold that makes
every large allocation a fresh mapping. On other C libraries (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

__all__ = ["release_free_memory"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None when the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the allocator's free memory to the OS; True when some was released (glibc only)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
