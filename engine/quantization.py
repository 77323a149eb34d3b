"""Which weight format an engine runs: ``EngineConfig.quantization`` -> "none" | "int8", with the reason.

    requested  device  int8 kernel path (cpu_kernels.q8_isa)   result
    none       any     -                                        none: weights in the engine dtype
    int8       cpu     any (avx512_vnni, avx2, portable)        int8
    int8       cuda    -                                        ConfigError (CPU kernels only)
    auto       any     any                                      none, until int8 is measured faster (below)

``auto`` may choose int8 only where it was measured faster end to end *and* passes the quality bar (top-1
agreement with float32 at least bf16's, mean KL at most twice bf16's; ``batchgen bench --quality``). int8
passes the bar only with float32 activations (with bf16 ones top-1 falls to 0.973 vs bf16's 0.982 on
gemma-3-270m), and measured on a 2-core AMD EPYC Zen 4 (AVX512-VNNI) that is not faster than bf16 on the
prefill-heavy ``shared-prefix`` bench (35.4 s vs 33.8 s: the int8 matmuls run at bf16's rate, ~350-420 GOP/s,
and float32 attention costs twice bf16's); its decode-only steps are 1.2x faster and its weights 0.63x
bf16's. On AVX2-only CPUs the int8 path (vpmaddwd) runs below torch's float32 matmul (~100-150 vs ~110-180
GOP/s, measured with the forced AVX2 build on that Zen 4). So ``auto`` resolves to none everywhere today;
``int8`` is an explicit choice for memory or decode-bound work.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class QuantChoice:
    name: str          # none | int8
    reason: str


def choose_quantization(requested: str, device_type: str, q8_isa: str | None) -> QuantChoice:
    """q8_isa: the loaded kernel build's int8 path, or None when no kernel library is available."""
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
    return QuantChoice("none", "auto: int8 not measured faster end to end than float weights on any CPU yet "
                               "(engine.quantization)")


def kernel_q8_isa() -> str | None:
    from engine import cpu_kernels
    lib = cpu_kernels.load()
    return cpu_kernels.q8_isa(lib) if lib is not None else None


__all__ = ["QuantChoice", "choose_quantization", "kernel_q8_isa"]
