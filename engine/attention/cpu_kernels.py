"""Native CPU kernels (plain C in ``csrc/``), built on first use with the system C compiler, called via ctypes.

Only what torch cannot do well on the CPU lives here: paged decode attention that reads keys and values in
place from the paged cache (torch needs a gather copy first). The build takes about a second, has no torch
headers, and is cached per source + flags + CPU under ``$BATCHGEN_CACHE_DIR`` (default
``~/.cache/batchgen/kernels``). Without a compiler, or with ``BATCHGEN_CPU_KERNELS=0``, the torch backend
uses its pure-torch path: same results within float rounding, slower decode.

The library links OpenMP (``-fopenmp``). torch's CPU wheels ship ``libgomp.so.1``; loading ours after torch
reuses that runtime (same soname), so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("batchgen.engine")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],                                   # no OpenMP: single-threaded, still gather-free
)
_FUNCS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def enabled() -> bool:
    return os.environ.get("BATCHGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchgen")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """Part of the cache key: -march=native output must not move to another CPU (shared home directories)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(cc: str, flag_sets=_FLAG_SETS) -> Path:
    """Compile the kernels with the first flag set that works (or reuse the cached build); the .so path."""
    src = SOURCE.read_bytes()
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(src + repr((cc, flags, _cpu_signature())).encode()).hexdigest()[:16]
        out = cache_dir() / f"paged_decode-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *flags, "-shared", "-fPIC", "-std=c11", str(SOURCE), "-o", tmp, "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)           # atomic: concurrent builders never see a partial file
                return out
            errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(flags)}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("; ".join(errors))


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in _FUNCS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int32] * 6 + [
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int32]
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (once logged) when disabled or no compiler can build it."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    _tried = True
    if not enabled():
        _error = "disabled by BATCHGEN_CPU_KERNELS=0"
        return None
    cc = _compiler()
    if cc is None:
        _error = "no C compiler (cc, gcc or clang) on PATH"
    else:
        try:
            _lib = open_library(build(cc))
        except OSError as e:
            _error = f"build failed: {e}"
    if _lib is None:
        log.warning("CPU attention kernel unavailable (%s); decode attention uses the slower torch path", _error)
    return _lib


def unavailable_reason() -> str | None:
    load()
    return _error


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode`` can run these tensors (CPU, bf16/fp32, matching dtypes) and the library loaded."""
    return (q.device.type == "cpu" and q.dtype in _FUNCS and k_cache.dtype == q.dtype
            and k_cache.shape[1] <= 256 and q.shape[1] // k_cache.shape[2] <= 64 and load() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] (one query per sequence, at position seq_lens[i] - 1, its K/V already in the cache).

    block_tables: [B, max_blocks] int32 (rows may be padded); seq_lens: [B] int32. Returns [B, Hq, D].
    """
    return call(load(), q, k_cache, v_cache, block_tables, seq_lens, window, scale)


def call(lib: ctypes.CDLL, q, k_cache, v_cache, block_tables, seq_lens, window, scale) -> torch.Tensor:
    """``paged_decode`` on a given build of the library (tests run a portable build too)."""
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    b, hq, d = q.shape
    out = torch.empty_like(q)
    rc = getattr(lib, _FUNCS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), b, hq, k_cache.shape[2], d, k_cache.shape[1], window or 0, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape q={tuple(q.shape)} cache={tuple(k_cache.shape)}")
    return out
