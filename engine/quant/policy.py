"""Which weight format an engine runs without a measurement: ``EngineConfig.quantization`` -> "none" | "int8", with
the reason. On a CPU ``auto`` is measured (engine.tuning); this table is its fallback (``BATCHGEN_TUNE=off``, CUDA)
and validates explicit requests.

    requested  device  kernel build                                        result
    none       any     -                                                    none: weights in the engine dtype
    int8       cpu     avx512_vnni + bf16 attention kernel, or AVX2-only    int8, KV cache auto: bf16 (as auto's)
    int8       cpu     any other int8 path (portable, ...)                  int8 (KV cache: the activation dtype)
    int8       cuda    -                                                    ConfigError (CPU kernels only)
    auto       cpu     avx512_vnni + bf16 attention kernel (AMX or not)     int8, float32 activations, bf16 KV
    auto       cpu     AVX2-only build (isa avx2, int8 path avx2)           int8, float32 activations, bf16 KV
    auto       cpu     anything else, or dtype: bfloat16                    none
    auto       cuda    -                                                    none
    auto       any     a float checkpoint (HF directory), any build         none

``auto`` is the default. This table is what it falls back to without a measurement (``BATCHGEN_TUNE=off``, CUDA),
and there it keeps a float checkpoint's weights float; the tuner (``engine.tuning``) measures int8 for float
checkpoints too and takes it where it is the fastest format within the quality bar (docs/design/quantization.md).

``auto`` may choose int8 only where it was measured faster end to end *and* passes the quality bar (top-1
agreement with float32 at least bf16's, mean KL at most twice bf16's; ``batchgen bench --quality``). The builds
above are those where it was (AVX512-VNNI with the bf16 attention kernel; AVX2-only builds); the measurements
behind each row: docs/design/quantization.md and docs/perf/code-notes-engine.md. On AMX CPUs too (until 2026-12-05
the table kept float weights there): on a 2-core Xeon with AMX the tuner measured int8 faster than bf16 on
gemma-3-270m and the Qwen2.5-0.5B shape (docs/perf/xeon-amx.md), and bf16 prompt rows through torch's AMX matmul
change bits with the token budget there (docs/guide/determinism.md). AVX-512 without VNNI is not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import engine.kernels.gemm as gemm
import engine.kernels.library as library
from engine.errors import ConfigError


@dataclass(frozen=True)
class QuantChoice:
    name: str          # none | int8
    reason: str
    kv_cache_dtype: str | None = None    # what kv_cache_dtype: auto becomes with this choice (None: the dtype's)


def choose_quantization(requested: str, device_type: str, q8_isa: str | None,
                        bf16_attention: bool = False, dtype: str = "auto",
                        kernel_isa: str | None = None, quantized_source: bool = True) -> QuantChoice:
    """q8_isa: the loaded kernel build's int8 path, or None when no kernel library is available.
    bf16_attention: the build multiplies bf16 into float32 for attention (``engine.kernels.gemm.bf16_gemm_ok``).
    dtype: the requested activation dtype (int8 under bf16 activations fails the bar).
    kernel_isa: the build's vector ISA (``engine.kernels.library.isa``): avx2 means no AVX-512 at all.
    quantized_source: the weights come quantized (a GGUF file); without a measurement ``auto`` keeps a float
    checkpoint's weights in float (the tuner measures int8 for it)."""
    if requested == "none":
        return QuantChoice("none", "quantization: none")
    if device_type != "cpu":
        if requested == "int8":
            raise ConfigError("quantization: int8 runs on the CPU only (our C kernels); use none on "
                              f"{device_type}")
        return QuantChoice("none", f"auto: no int8 kernels for {device_type}")
    if requested == "int8":
        if q8_isa is None:
            raise ConfigError("quantization: int8 needs the native CPU kernels, which are unavailable "
                              "(no C compiler, or BATCHGEN_CPU_KERNELS=0)")
        if _bf16_kv_measured(q8_isa, bf16_attention, kernel_isa):
            # NOTE: explicit int8 picks the auto KV cache dtype too: bf16, since a cache in the activation dtype
            # (float32) measured slower (docs/perf/code-notes-engine.md)
            return QuantChoice("int8", f"quantization: int8 ({q8_isa} dot products; KV cache auto: bf16, measured "
                                       "faster here and within the quality bar)", kv_cache_dtype="bfloat16")
        return QuantChoice("int8", f"quantization: int8 ({q8_isa} dot products)")
    if not quantized_source:
        return QuantChoice("none", "auto without a measurement: a float checkpoint keeps float weights (the tuner "
                                   "measures int8 for it; quantization: int8 quantizes at load)")
    if dtype == "bfloat16":
        return QuantChoice("none", "auto: int8 under bf16 activations fails the quality bar (engine.quant.policy)")
    if _bf16_kv_measured(q8_isa, bf16_attention, kernel_isa):
        reason = ("auto: int8 weights (avx512_vnni) with a bf16 KV cache: measured faster than bf16 end to end and "
                  "within the quality bar on AVX512-VNNI + AVX512-BF16 CPUs (engine.quant.policy)"
                  if q8_isa == "avx512_vnni" else
                  "auto: int8 weights (avx2 vpmaddubsw) with float32 activations and a bf16 KV cache: measured "
                  "faster than float32 end to end and within the quality bar on AVX2-only CPUs "
                  "(engine.quant.policy)")
        return QuantChoice("int8", reason, kv_cache_dtype="bfloat16")
    return QuantChoice("none", f"auto: int8 not measured faster than float weights on this CPU (int8 path "
                               f"{q8_isa or 'unavailable'}{'' if bf16_attention else ', no bf16 attention kernel'}"
                               f"; engine.quant.policy)")


def _bf16_kv_measured(q8_isa: str | None, bf16_attention: bool, kernel_isa: str | None) -> bool:
    """The builds where int8 weights with a bf16 KV cache were measured faster and within the bar (the table above):
    AVX512-VNNI with the bf16 attention kernel, and AVX2-only builds."""
    return (q8_isa == "avx512_vnni" and bf16_attention) or (q8_isa == "avx2" and kernel_isa == "avx2")


def kernel_q8_isa() -> str | None:
    lib = library.load()
    return library.q8_isa(lib) if lib is not None else None


def kernel_bf16_attention() -> bool:
    return gemm.bf16_gemm_ok()


def kernel_isa() -> str | None:
    lib = library.load()
    return library.isa(lib) if lib is not None else None


__all__ = ["QuantChoice", "choose_quantization", "kernel_bf16_attention", "kernel_isa", "kernel_q8_isa"]
