"""Which dtype ``dtype: auto`` means on this device, and why: one function, one table.

    device   what the hardware has                                   auto      why
    -------  ------------------------------------------------------  --------  ------------------------------------
    cuda     bf16 support (Ampere and later)                         bfloat16  tensor cores, half the bytes of fp32
    cuda     no bf16 (Volta, Turing)                                 float16   the fast half type there
    cpu      AMX-BF16 (Sapphire Rapids and later Xeons)              bfloat16  AMX tiles: ~3x fp32 matmul
    cpu      AVX512-BF16 (Zen 4 and later, Cooper Lake)              bfloat16  vdpbf16ps: ~2.5x fp32 on Zen 4
    cpu      anything else (AVX2-only x86, AVX-512 without BF16,    float32   torch's bf16 matmul falls back to scalar
             aarch64, ...)                                                     code there: ~200x slower than fp32

The ratios in the table: docs/perf/code-notes-engine.md.

CPU features come from ``engine.kernels.cpu_features`` (torch's own probes, the ones its kernels dispatch on, with
``/proc/cpuinfo`` flags as a second source where torch lacks a probe).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.kernels.cpu_features import cpu_features

log = logging.getLogger("batchgen.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "int8": torch.int8}    # kv_cache_dtype -> the pool's dtype (int8: engine.quant.int8_kv's bytes)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                 # "bfloat16" | "float16" | "float32"
    reason: str                # one line for logs, manifests and the report header
    slow: bool = False         # an explicit choice this hardware runs far below its best dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def cpu_has_bf16_matmul(features: frozenset[str] | None = None) -> bool:
    features = cpu_features() if features is None else features
    return bool({"amx_bf16", "avx512_bf16"} & features)


def choose_dtype(requested: str, device_type: str, features: frozenset[str] | None = None,
                 cuda_bf16: bool | None = None) -> DtypeChoice:
    """Resolve ``requested`` (auto | bfloat16 | float16 | float32) for ``device_type`` (cpu | cuda).

    ``features`` / ``cuda_bf16`` default to probing this machine; tests pass them in.
    """
    if device_type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported()
        if requested != "auto":
            return DtypeChoice(requested, f"{requested} requested")
        if cuda_bf16:
            return DtypeChoice("bfloat16", "bfloat16 chosen: this GPU supports bf16")
        return DtypeChoice("float16", "float16 chosen: this GPU has no bf16 support")
    features = cpu_features() if features is None else features
    fast_bf16 = cpu_has_bf16_matmul(features)
    units = "AMX-BF16" if "amx_bf16" in features else "AVX512-BF16"
    if requested == "auto":
        if fast_bf16:
            return DtypeChoice("bfloat16", f"bfloat16 chosen: this CPU has bf16 matmul units ({units})")
        return DtypeChoice("float32", "float32 chosen: this CPU has no bf16 matmul units (no AMX-BF16 or "
                                      "AVX512-BF16)")
    if requested == "bfloat16" and not fast_bf16:
        return DtypeChoice("bfloat16", "bfloat16 requested, but this CPU has no bf16 matmul units (no AMX-BF16 "
                                       "or AVX512-BF16): matmuls run ~100x slower than float32; use dtype: auto "
                                       "or float32", slow=True)
    return DtypeChoice(requested, f"{requested} requested")


def log_choice(choice: DtypeChoice) -> None:
    """Log the choice (a warning when it will be slow); engines call it once, when they start."""
    (log.warning if choice.slow else log.info)("dtype: %s", choice.reason)


__all__ = ["DtypeChoice", "DTYPES", "choose_dtype", "log_choice", "cpu_has_bf16_matmul"]
