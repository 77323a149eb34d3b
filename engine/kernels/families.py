"""The kernel families that have a C and a torch implementation, chosen once per family for every row count and
for prefill and decode alike (measured by engine.tuning, or set by ``EngineConfig.kernels``):

    elementwise  rms_norm, residual_norm, qk_norm_rope, glu: "c" | "torch"
    lm_head      a float head's logits: "c" (csrc/small_m/ at every row count) | "torch" | "table" (the C kernel up
                 to gemm.SMALL_M_MAX rows, torch beyond: the rule when nothing was measured)
    linears      float linears' rows of output positions (decode): "c" (csrc/small_m/, row-invariant at every
                 row count) | "torch" (torch's matmul, padded to an invariant row count). Prompt rows: torch,
                 unless prefill_linears says otherwise.
    prefill_linears  under linears "c" (weights held as panels), the prompt rows: "c" (the panel kernel blocked as a
                 GEMM, csrc/panel/: every row one chain, so a prompt's bits do not depend on its chunking) | "torch"
                 (the panels unpacked into a float32 buffer, torch's matmul). Not measured by the tuner: "torch"
                 unless a config names "c". One layer's calls alone time "c" faster at a few hundred rows, while
                 whole engine steps of thousands of rows over every layer's weights run slower with it
                 (docs/perf/avx2.md), so the probe's one-layer calls would choose it wrongly.
    int8_prompts the prompt rows of int8 linears: "int8" (the int8 dot products, as every output row) | "bf16"
                 (AMX-BF16 tiles over the weights dequantized to bf16, bf16 activations, float32 sums:
                 csrc/qlinear/amx_prompt.h; only where the build and the CPU have AMX-BF16). A prompt position is
                 always computed by the one and an output position by the other, so a row's bits never depend on
                 its step's other rows.
    attention    prefill over a bf16 or int8 KV cache: "c" (bf16 multiplied into float32, csrc/bf16_gemm/, where the
                 build has bf16 dot products) | "torch" (torch's matmuls in the activation dtype; float32 queries
                 read the cache as float32). Decode attention is the C kernel wherever it builds.

Kept free of torch so that a config can be checked without loading it.
"""
KERNEL_FAMILIES = {"elementwise": ("c", "torch"), "lm_head": ("c", "torch", "table"), "attention": ("c", "torch"),
                   "linears": ("c", "torch"), "prefill_linears": ("c", "torch"), "int8_prompts": ("int8", "bf16")}
TABLE_KERNELS = {"elementwise": "c", "lm_head": "table", "attention": "c", "linears": "c", "prefill_linears": "torch",
                 "int8_prompts": "int8"}


def check_kernels(kernels: dict) -> None:
    """ValueError naming an unknown family or implementation."""
    for family, impl in kernels.items():
        if family not in KERNEL_FAMILIES:
            raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(KERNEL_FAMILIES)}")
        if impl not in KERNEL_FAMILIES[family]:
            raise ValueError(f"kernels.{family} must be one of {', '.join(KERNEL_FAMILIES[family])}, got {impl!r}")
