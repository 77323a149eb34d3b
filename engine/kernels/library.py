"""The kernel library of this process: built (or taken from the cache) and loaded once, on first use."""
from __future__ import annotations

import logging
import os

import torch

import engine.kernels.build as build
from engine.kernels.binding import KernelLibrary, open_library

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
    """The kernel library, built if needed; None (once logged) when disabled or no compiler can build it."""
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
    else:
        try:
            path = build.build(cc)
            _lib, _path = open_library(path), path.name
        except OSError as e:
            _error = f"build failed: {e}"
    if _lib is None:
        log.warning("CPU attention kernel unavailable (%s); decode attention uses the slower torch path", _error)
    return _lib


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
    return f"{isa(lib)} build, int8 {q8_isa(lib)}" if lib is not None else f"unavailable ({_error}); torch path"
