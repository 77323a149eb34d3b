"""Which weight format an engine runs: ``EngineConfig.quantization`` -> "none" | "int8", with the reason.

    requested  device  int8 kernel path (cpu_kernels.q8_isa)   result
    none       any     -                                        none: weights in the engine dtype
    int8       cpu     any (avx512_vnni, avx2, portable)        int8
    int8       cuda    -                                        ConfigError (CPU kernels only)
    auto       any     any                                      none, until int8 is measured faster (below)

``auto`` may choose int8 only where it was measured faster end to end *and* passes the quality bar (top-1
agreement with float32 at least bf16's, mean KL at most twice bf16's; ``batchgen bench --quality``). Measured on
a 2-core AMD EPYC Zen 4 (AVX512-VNNI, AVX512-BF16), ``batchgen bench shared-prefix``, one run:

    int8, float32 activations and KV     passes the bar (top-1 0.9833, KL 0.00101)   0.89x bf16's wall time
    int8, float32 activations, bf16 KV   top-1 0.9819 < bf16's 0.9824, KL 0.00112     1.30x bf16's wall time
    int8, bf16 activations               top-1 0.9733, KL 0.00166                      (fails clearly)

The int8 matmuls themselves run at 500-570 GOP/s against torch bf16's 380-410; with float32 activations the
attention runs in float32 at half bf16's rate, which eats the gain. The one variant that is faster misses the
top-1 criterion: by one position of 2,100, and at 20,000+ positions by 0.19 points (0.9803 vs 0.9822; int8
with float32 KV 0.9832 there). On AVX2-only CPUs the int8 path (vpmaddwd) runs at about float32 matmul's
rate. So ``auto`` resolves to none everywhere today; ``int8`` is an explicit choice (0.63x
bf16's weight memory; with ``kv_cache_dtype: bfloat16`` the fastest configuration on bf16-capable CPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class QuantChoice:
    name: str          # none | int8
    reason: str
    kv_cache_dtype: str | None = None    # what kv_cache_dtype: auto becomes with this choice (None: the dtype's)


def choose_quantization(requested: str, device_type: str, q8_isa: str | None,
                        bf16_attention: bool = False, dtype: str = "auto") -> QuantChoice:
    """q8_isa: the loaded kernel build's int8 path, or None when no kernel library is available.
    bf16_attention: the build multiplies bf16 into float32 for attention (``cpu_kernels.bf16_gemm_ok``:
    AVX512-BF16, no AMX). dtype: the requested activation dtype (int8 under bf16 activations fails the bar)."""
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
        return QuantChoice("int8", f"quantization: int8 ({q8_isa} dot products)")
    if dtype == "bfloat16":
        return QuantChoice("none", "auto: int8 under bf16 activations fails the quality bar (engine.quantization)")
    if q8_isa == "avx512_vnni" and bf16_attention:
        return QuantChoice("int8", "auto: int8 weights (avx512_vnni) with a bf16 KV cache: measured faster than "
                                   "bf16 end to end and within the quality bar on AVX512-VNNI + AVX512-BF16 CPUs "
                                   "without AMX (engine.quantization)", kv_cache_dtype="bfloat16")
    return QuantChoice("none", f"auto: int8 not measured faster than float weights on this CPU (int8 path "
                               f"{q8_isa or 'unavailable'}{'' if bf16_attention else ', no bf16 attention kernel'}; "
                               "engine.quantization)")


def kernel_q8_isa() -> str | None:
    from engine import cpu_kernels
    lib = cpu_kernels.load()
    return cpu_kernels.q8_isa(lib) if lib is not None else None


def kernel_bf16_attention() -> bool:
    from engine import cpu_kernels
    return cpu_kernels.bf16_gemm_ok()


__all__ = ["QuantChoice", "choose_quantization", "kernel_bf16_attention", "kernel_q8_isa"]
