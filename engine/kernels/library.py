"""The kernel library of this process: built (or taken from the cache) and loaded once, on first use."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

import engine.kernels.build as build
from engine.kernels.binding import KernelLibrary
from engine.kernels.library_check import load_checked

log = logging.getLogger("batchgen.engine")

# torch dtype -> the suffix of the C function for it
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}

_lib: KernelLibrary | None = None
_tried = False
_error: str | None = None
_path: str | None = None


def enabled() -> bool:
    return os.environ.get("BATCHGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def load() -> KernelLibrary | None:
    """The kernel library, built if needed and checked (``library_check``: a damaged one is built again once); None
    (once logged, with how to fix it) when disabled or no compiler can build a library that passes."""
    global _lib, _tried, _error, _path
    if _tried:
        return _lib
    _tried = True
    if not enabled():
        _error = "disabled by BATCHGEN_CPU_KERNELS=0"
        return None
    cc = build.compiler()
    if cc is None:
        _error = "no C compiler (cc, gcc or clang) on PATH"
        fix = "install one, or set CC to one"
    else:
        try:
            _lib = load_checked(cc)
            _path = Path(_lib.path).name
            _lib.bf16_gemm_amx(int(amx_wanted()))
        except OSError as e:
            _error = f"build failed: {e}"
        fix = f"make `{cc}` build the kernels (or set CC to a C compiler that does) and run again"
    if _lib is None:
        log.warning("CPU kernels unavailable (%s); the slower torch path runs instead. To fix: %s (the library is "
                    "built into %s)", _error, fix, build.cache_dir())
    return _lib


def amx_wanted() -> bool:
    """``BATCHGEN_AMX=0`` keeps the kernels off AMX tiles (bf16_gemm: prefill attention over a bf16 cache; the int8
    linears' prompt rows, ``qlinear.prompt_amx_ok``); on by default where the build, the CPU and the kernel allow
    them."""
    return os.environ.get("BATCHGEN_AMX", "1").lower() not in ("0", "false", "no", "off")


def amx_tiles(lib: KernelLibrary) -> bool:
    """Whether this process's bf16_gemm runs on AMX tiles."""
    return bool(lib.bf16_gemm_amx(int(amx_wanted())))


def unavailable_reason() -> str | None:
    load()
    return _error


def isa(lib: KernelLibrary) -> str:
    """The instruction set a build's fast paths use: avx512_bf16 | avx512 | avx2 | portable (see csrc/dispatch.h)."""
    return lib.batchgen_kernel_isa().decode()


def q8_isa(lib: KernelLibrary) -> str:
    """The integer dot-product path of a build's int8 linear: avx512_vnni | avx2 | portable (csrc/qlinear/)."""
    return lib.batchgen_q8_isa().decode()


def build_id() -> str:
    """Which build runs (its cache file name: sources + flags + compiler + CPU), or why none: part of a cache key."""
    return _path if load() is not None and _path else f"none ({_error})"


def describe() -> str:
    """One line for logs, manifests and the report: which kernel build runs here, or why none does."""
    lib = load()
    if lib is None:
        return f"unavailable ({_error}); torch path"
    return f"{isa(lib)} build, int8 {q8_isa(lib)}{', bf16 attention on AMX tiles' if amx_tiles(lib) else ''}"
