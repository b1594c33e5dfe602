"""The exporter's memory: the figures progress lines give, and freed memory handed back.

glibc's malloc keeps freed blocks below its mmap threshold in its heap, and raises the threshold
(up to 32 MB) whenever a larger mapped block is freed; a loop that reads, upcasts and drops a
layer's tensors of a few MB each then grows the heap though it holds nothing. ``trim`` after each layer gives the free
pages back (malloc_trim; a no-op without glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def usage() -> str:
    """Resident memory now and at its peak, for progress lines (Linux; elsewhere the peak where
    the platform has ``resource``, else nothing)."""
    try:
        import resource  # Unix only: Windows has no such module
    except ImportError:
        return "memory not measured on this platform"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    try:
        with open("/proc/self/statm") as statm:
            now = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return f"peak memory {peak / 2**30:.1f} GB"
    return f"memory {now / 2**30:.1f} GB, peak {peak / 2**30:.1f} GB"


def trim() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl, Windows)
        return None


_malloc_trim = _find_malloc_trim()
