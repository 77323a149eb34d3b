"""A model's weights moved into transparent huge pages (2 MiB) once it is loaded, on Linux CPUs.

A decode step streams every weight once. In 4 KiB pages that is a TLB miss every 4 KiB, and the hardware
prefetchers stop at each page boundary; the weights as loaded are in 4 KiB pages whatever the system's THP
setting (a memory-mapped weights cache is file-backed; ``madvise`` is the common setting for anonymous memory). So
every weight tensor of 2 MiB or more is copied into one anonymous mapping advised ``MADV_HUGEPAGE``, and the
tensor's storage replaced in place (``t.data = copy``): tied weights stay one tensor, modules keep their
attributes. Measured on Zen 4 (docs/perf/code-notes-kernels.md): a decode step's int8 linears at Qwen2.5-1.5B
shapes 9 % faster at 1 and at 8 rows. Values never change; only the pages that hold them.

The copy is the weights' size in anonymous memory where the mapped cache file's pages were (every tensor, the
small ones into ordinary memory, so the file is unmapped and its pages left to the page cache), and takes about
0.3 s a GB. ``BATCHGEN_HUGE_PAGES=0`` turns it off; where THP is
off (``never``) or ``MADV_HUGEPAGE`` is missing, nothing is moved.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

MIN_BYTES = 2 << 20                  # smaller tensors are left where they are
_HUGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """True where anonymous memory can be advised into huge pages and the user has not turned it off."""
    if os.environ.get("BATCHGEN_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def move_weights(model: torch.nn.Module, min_bytes: int | None = None) -> int:
    """Every CPU parameter and buffer of ``model`` of at least ``min_bytes`` (default ``MIN_BYTES``) into one
    huge-page-advised mapping; returns the bytes moved (0 where ``available()`` is false)."""
    if not available():
        return 0
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    seen, big, small = set(), [], []
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "cpu" or id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        (big if nbytes >= min_bytes and t.is_contiguous() else small).append((t, nbytes))
    if not big:
        return 0
    with torch.no_grad():
        # the small ones copied too, so no tensor keeps a memory-mapped weights file mapped (its pages would stay
        # resident beside the copies)
        for t, _ in small:
            t.data = t.clone()
    offsets, total = [], 0
    for _, nbytes in big:
        offsets.append(total)
        total += -(-nbytes // 64) * 64                 # each tensor 64-byte aligned, as the kernels expect
    # private: a shared anonymous mapping is shmem, which takes huge pages only where shmem_enabled says so
    region = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any weight uses it
    start = -raw.data_ptr() % _HUGE                    # the first tensor on a huge page boundary
    old = []
    with torch.no_grad():
        for (t, nbytes), off in zip(big, offsets):
            dst = raw[start + off:start + off + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t)
            old.append((t.data_ptr(), nbytes))
            t.data = dst
    _drop_file_pages(old)
    return sum(nbytes for _, nbytes in big)


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of a file (/proc/self/maps lines with a path)."""
    out = []
    try:
        for line in open("/proc/self/maps"):
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def _drop_file_pages(ranges: list[tuple[int, int]]) -> None:
    """The copied weights' old pages, where they lie in a memory-mapped file (safetensors keeps its mapping after
    the tensors are gone), dropped from this process (MADV_DONTNEED): private and never written, they would be read
    back from the file if touched, so this only frees memory. Anonymous memory is never touched here."""
    files = _file_mappings()
    if not files or not hasattr(mmap, "MADV_DONTNEED"):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    for ptr, nbytes in ranges:
        a, b = -(-ptr // page) * page, (ptr + nbytes) // page * page
        if b > a and any(s <= a and b <= e for s, e in files):
            libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), mmap.MADV_DONTNEED)


__all__ = ["MIN_BYTES", "available", "move_weights"]
