"""Which weight format an engine runs: ``EngineConfig.quantization`` -> "none" | "int8", with the reason.

    requested  device  kernel build                                        result
    none       any     -                                                    none: weights in the engine dtype
    int8       cpu     avx512_vnni + bf16 attention kernel, or AVX2-only    int8, KV cache auto: bf16 (as auto's)
    int8       cpu     any other int8 path (portable, ...)                  int8 (KV cache: the activation dtype)
    int8       cuda    -                                                    ConfigError (CPU kernels only)
    auto       cpu     avx512_vnni + bf16 attention kernel (bf16_gemm_ok)   int8, float32 activations, bf16 KV
    auto       cpu     AVX2-only build (isa avx2, int8 path avx2)           int8, float32 activations, bf16 KV
    auto       cpu     anything else, or dtype: bfloat16                    none
    auto       cuda    -                                                    none
    auto       any     a float checkpoint (HF directory), any build         none

``auto`` is the default. It considers int8 only for weights that come quantized (GGUF): the quality bar was
measured on the default model's GGUF weights, and a float checkpoint's user asked for float weights unless they
say ``int8``.

``auto`` may choose int8 only where it was measured faster end to end *and* passes the quality bar (top-1
agreement with float32 at least bf16's, mean KL at most twice bf16's; ``batchgen bench --quality``). Measured on
a 2-core AMD EPYC Zen 4 (AVX512-VNNI, AVX512-BF16, no AMX), 20,000+ positions and ``batchgen bench
shared-prefix`` in one run:

    bf16                                 top-1 0.9792, KL 0.00060                      1 (32.9 s)
    int8, float32 activations and KV     top-1 0.9850, KL 0.00083: meets the bar       1.03x bf16's speed
    int8, float32 activations, bf16 KV   top-1 0.9869, KL 0.00088: meets the bar       1.35x (decode step 1.48x)
    int8, float32 activations, int8 KV   top-1 0.9871, KL 0.00104: meets the bar       ~int8 + bf16 KV's
                                         (2,100 positions; kv_cache_dtype: int8, opt-in: engine.quant.int8_kv)
    int8, bf16 activations               top-1 0.9786, KL 0.00146: fails               -

The int8 matmuls run at 500-570 GOP/s against torch bf16's 380-410. A bf16 KV cache costs little because
bf16 attention multiplies into float32 there (csrc/bf16_gemm.c); it halves decode's KV bytes.

AVX2-only CPUs (the kernels built with ``BATCHGEN_KERNEL_FLAGS="-O3 -mavx2 -mfma -fopenmp"`` on the same Zen 4,
whose float32 matmul has the FMA throughput of a Zen 3's): the avx2 int8 linear (vpmaddubsw) runs at 1.8-1.9x
torch's float32 matmul per thread (1.4x on weights beyond +-64, which take the sign trick; weights within +-16, the
default GGUF's Q5_0 tensors, sum four steps in int16: 1.07x end to end), and in five
``--dtype float32`` shared-prefix runs int8 was 1.27-1.61x float32's wall time (decode steps 1.53-2.34x).
Since prefill attention runs in one C call (csrc/prefill.c: keys converted to float32 once per chunk) a bf16
KV cache is faster there too (one run: int8 + bf16 KV 1.55x float32's wall, decode step 2.25x; int8 + float32
KV 1.42x / 1.90x; with the int16 sums, in a slower session: 1.71x, decode step 2.70x), and ``auto`` picks it;
10,000+ positions: top-1 0.9824, KL 0.00086 (float32 KV 0.9843 / 0.00090) against bf16's 0.9765 / 0.00068.
Weights within +-64 everywhere (so every avx2 linear takes the direct path) were measured and fail the bar:
re-quantizing the Q4_K / Q6_K tensors to +-64 gave KL 0.00148, and Q8_0 (the tied LM head) too 0.00325, against
the bar's 0.00136. Not chosen:
AVX-512 without VNNI takes the avx2 int8 path against an AVX-512 float32 matmul (two FMA units on Intel's):
not measured; on AMX CPUs torch's bf16 matmul runs on AMX tiles (750-2,000 GFLOP/s), which our VNNI kernels do
not approach.
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
    bf16_attention: the build multiplies bf16 into float32 for attention (``engine.kernels.gemm.bf16_gemm_ok``:
    AVX512-BF16, no AMX). dtype: the requested activation dtype (int8 under bf16 activations fails the bar).
    kernel_isa: the build's vector ISA (``engine.kernels.library.isa``): avx2 means no AVX-512 at all.
    quantized_source: the weights come quantized (a GGUF file), which is where int8's quality was measured;
    ``auto`` keeps a float checkpoint's weights in float."""
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
            # NOTE: the KV cache auto picks too: explicit int8 used to keep it in the activation dtype (float32),
            # which on Zen 4 ran 1.03x bf16 against 1.35x with a bf16 cache (the table above)
            return QuantChoice("int8", f"quantization: int8 ({q8_isa} dot products; KV cache auto: bf16, measured "
                                       "faster here and within the quality bar)", kv_cache_dtype="bfloat16")
        return QuantChoice("int8", f"quantization: int8 ({q8_isa} dot products)")
    if not quantized_source:
        return QuantChoice("none", "auto: a float checkpoint keeps float weights (int8's quality bar was measured on "
                                   "GGUF-quantized weights; quantization: int8 quantizes at load)")
    if dtype == "bfloat16":
        return QuantChoice("none", "auto: int8 under bf16 activations fails the quality bar (engine.quant.policy)")
    if _bf16_kv_measured(q8_isa, bf16_attention, kernel_isa):
        reason = ("auto: int8 weights (avx512_vnni) with a bf16 KV cache: measured faster than bf16 end to end and "
                  "within the quality bar on AVX512-VNNI + AVX512-BF16 CPUs without AMX (engine.quant.policy)"
                  if q8_isa == "avx512_vnni" else
                  "auto: int8 weights (avx2 vpmaddubsw) with float32 activations and a bf16 KV cache: measured "
                  "faster than float32 end to end and within the quality bar on AVX2-only CPUs "
                  "(engine.quant.policy)")
        return QuantChoice("int8", reason, kv_cache_dtype="bfloat16")
    return QuantChoice("none", f"auto: int8 not measured faster than float weights on this CPU (int8 path "
                               f"{q8_isa or 'unavailable'}{'' if bf16_attention else ', no bf16 attention kernel'}; "
                               "engine.quant.policy)")


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
