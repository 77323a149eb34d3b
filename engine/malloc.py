"""glibc malloc settings, applied once when an engine starts on the CPU.

glibc's malloc serves allocations above 128 KiB with fresh mmap()s and returns them on free, so every
activation, KV gather and logits buffer of every step page-faults its memory in again. Raising the mmap and
trim thresholds keeps freed memory in the heap for reuse (what tcmalloc/jemalloc do for CPU inference;
measured faster: docs/perf/code-notes-engine.md). The process keeps its peak
heap instead of returning it to the OS, which suits a batch job.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("batchgen.engine")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc for reuse; a no-op (False) where glibc is not the allocator."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # NOTE: 1 GiB is glibc's ceiling for the mmap threshold (HEAP_MAX / 2 on 64-bit would be 32 MiB by default
    # when dynamic; an explicit value disables the dynamic adjustment).
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    _applied = ok
    if not ok:
        log.info("mallopt tuning not applied")
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's freed memory back to the OS (``malloc_trim``): for a process that drops an engine and then
    starts something that needs the memory (``batchgen bench`` before a peer). False where glibc is not the
    allocator."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
