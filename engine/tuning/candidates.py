"""The ways this engine can run a model here (the tuner's candidates), which of them pass the quality bar, and the
table choice that ``BATCHGEN_TUNE=off`` (or a device the tuner does not measure) falls back to.

A candidate is a *format* (weights none | int8, the activation dtype, the KV cache dtype) plus, per kernel family
where both exist, C or torch (``engine.kernels.families``). ``auto`` fields vary, explicit ones do not:

    field            auto's candidates
    quantization     none; int8 too where the int8 kernels load (weights that come quantized, GGUF, or float
                     ones quantized at load: docs/design/quantization.md says why)
    dtype            float32; bfloat16 too where the CPU has bf16 matmul units (AMX-BF16 or AVX512-BF16)
    kv_cache_dtype   the activation dtype, and bfloat16
    kernel families  c and torch, where the kernel library loads (lm_head, linears: float weights only; attention:
                     a bf16 or int8 KV cache, where the build has bf16 dot products)

Quality is a property of the format, measured once by ``batchgen bench --quality`` against float32 and recorded
here (``QUALITY``), not re-measured on each machine: the bar and its figures are docs/design/quantization.md's.
"""
from __future__ import annotations

from dataclasses import dataclass

import engine.kernels.cpu_features as cpu_features
from engine.dtype_policy import DtypeChoice, choose_dtype, cpu_has_bf16_matmul
from engine.quant.policy import QuantChoice, choose_quantization, kernel_bf16_attention, kernel_isa, kernel_q8_isa

# (weights, activations) and KV cache dtype -> (passes the bar, why). A format passes when both parts do.
QUALITY_WEIGHTS = {
    ("none", "float32"): (True, "the reference"),
    ("none", "bfloat16"): (True, "bf16 defines the bar"),
    ("int8", "float32"): (True, "int8 weights + float32 activations: within the bar (bench --quality)"),
    ("int8", "bfloat16"): (False, "int8 weights + bf16 activations: fail the bar (bench --quality)"),
}
QUALITY_KV = {
    "float32": (True, "the reference"),
    "bfloat16": (True, "a bf16 KV cache: within the bar (bench --quality; bf16's own roundings)"),
    "int8": (True, "int8 KV with the key shift: within the bar (bench --quality)"),
}


@dataclass(frozen=True)
class Format:
    quantization: str          # none | int8
    dtype: str                 # activations: bfloat16 | float32
    kv_cache_dtype: str        # bfloat16 | float32 | int8

    @property
    def name(self) -> str:
        return f"{self.quantization}/{self.dtype}/kv-{self.kv_cache_dtype}"

    def quality(self) -> tuple[bool, str]:
        """(passes the quality bar, why): the recorded table; unknown formats do not pass."""
        w = QUALITY_WEIGHTS.get((self.quantization, self.dtype), (False, "not measured"))
        kv = QUALITY_KV.get(self.kv_cache_dtype, (False, "not measured"))
        return w[0] and kv[0], "; ".join(dict.fromkeys((w[1], kv[1])))


@dataclass(frozen=True)
class KernelFacts:
    """What the table reads about this machine's kernel build (None / False where no library is loaded)."""
    q8_isa: str | None = None          # the int8 linear's dot products: avx512_vnni | avx2 | portable
    bf16_attention: bool = False       # bf16 multiplied into float32 for attention (engine.kernels.gemm)
    isa: str | None = None             # the build's vector ISA
    bf16_units: bool = False           # the CPU has bf16 matmul units (engine.dtype_policy)
    amx: bool = False                  # AMX tiles (reported; the table treats AMX CPUs as their VNNI build)
    amx_prompts: bool = False          # int8 linears' prompt rows can run on AMX-BF16 tiles (qlinear.prompt_amx_ok)

    @property
    def kernels(self) -> bool:
        return self.isa is not None


def kernel_facts(device_type: str, load_kernels: bool) -> KernelFacts:
    """This machine's facts; ``load_kernels`` False leaves the kernel library unloaded (the table did not need it)."""
    if device_type != "cpu":
        return KernelFacts()
    bf16 = cpu_has_bf16_matmul()
    if not load_kernels:
        return KernelFacts(bf16_units=bf16)
    from engine.kernels.qlinear import prompt_amx_ok
    return KernelFacts(kernel_q8_isa(), kernel_bf16_attention(), kernel_isa(), bf16, cpu_features.has_amx(),
                       prompt_amx_ok())


def table_choice(requested_quant: str, requested_dtype: str, requested_kv: str, device_type: str,
                 quantized_source: bool, facts: KernelFacts) -> tuple[QuantChoice, DtypeChoice, str]:
    """The table's choice (engine.quant.policy, engine.dtype_policy): quantization, dtype, KV cache dtype."""
    quant = choose_quantization(requested_quant, device_type, facts.q8_isa, facts.bf16_attention, requested_dtype,
                                facts.isa, quantized_source=quantized_source)
    if quant.name == "int8" and requested_dtype == "auto":
        # NOTE: int8 weights pass the quality bar with float32 activations and fail it with bf16 ones (QUALITY)
        choice = DtypeChoice("float32", "auto with int8 weights: float32 activations (bf16 activations fail "
                                        "int8's quality bar)")
    else:
        choice = choose_dtype(requested_dtype, device_type)      # auto: by device and instruction set
    kv = (quant.kv_cache_dtype or choice.dtype) if requested_kv == "auto" else requested_kv
    return quant, choice, kv


def format_candidates(requested_quant: str, requested_dtype: str, requested_kv: str,
                      facts: KernelFacts) -> list[Format]:
    """Every format the tuner may measure for these requests on this CPU: explicit fields fixed, auto ones varied,
    a format that fails the quality bar left out unless every field of it was asked for by name. int8 weights are
    a candidate for any source, GGUF or float (quantized at load)."""
    quants = ([requested_quant] if requested_quant != "auto" else
              ["none", "int8"] if facts.q8_isa is not None else ["none"])
    dtypes = ([requested_dtype] if requested_dtype != "auto" else
              ["bfloat16", "float32"] if facts.bf16_units else ["float32"])
    explicit = "auto" not in (requested_quant, requested_dtype, requested_kv)
    out = []
    for q in quants:
        for d in dtypes:
            kvs = [requested_kv] if requested_kv != "auto" else list(dict.fromkeys((d, "bfloat16")))
            out += [f for kv in kvs if (f := Format(q, d, kv)).quality()[0] or explicit]
    return out


def family_options(fmt: Format, facts: KernelFacts) -> dict[str, tuple[str, ...]]:
    """Kernel family -> the implementations to measure under ``fmt`` (both exist only with the kernel library; an
    int8 head is C only)."""
    if not facts.kernels:
        return {}
    families = {"elementwise": ("c", "torch")}
    if fmt.quantization == "none":
        families["lm_head"] = ("c", "torch")
        families["linears"] = ("c", "torch")           # float linears' decode rows
    if fmt.quantization == "int8" and facts.amx_prompts:
        families["int8_prompts"] = ("int8", "bf16")    # int8 linears' prompt rows: dot products or AMX bf16 tiles
    if fmt.kv_cache_dtype in ("bfloat16", "int8") and facts.bf16_attention:
        families["attention"] = ("c", "torch")        # prefill over a low-precision cache: bf16 kernel or torch
    return families


__all__ = ["Format", "KernelFacts", "QUALITY_WEIGHTS", "QUALITY_KV", "kernel_facts", "table_choice",
           "format_candidates", "family_options"]
