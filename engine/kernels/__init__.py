"""Native CPU kernels (plain C in ``csrc/``), built on first use with the system C compiler, called via ctypes.

Only what torch cannot do well on the CPU lives here:
- paged decode attention that reads keys and values in place from the paged cache (torch needs a gather copy
  first), and prefill attention over packed bf16 or float32 operands: ``attention``;
- fused elementwise passes in bf16 and float32 (GeGLU/SwiGLU, RMSNorm with optional RoPE, RoPE, the residual add
  with its norms, the prefill tile's masked softmax): ``elementwise``; torch would make three to five passes;
- the KV cache writes (float, bf16 and int8 caches): ``kv_write``;
- int8 linear layers with integer dot products: ``qlinear``; bf16 x bf16 -> float32 and few-row matmuls: ``gemm``;
- n-gram speculation proposals: ``ngram``.

The modules: ``csrc/kernels.h`` declares every C function Python calls; ``binding`` reads the ctypes signatures
from it; ``build`` owns the compiler, the flag sets and the build cache; ``library`` loads (builds) the one library
of this process, which ``library_check`` checks first (``elf`` reads the file) and rebuilds once when damaged;
``cpu_features`` is the one place that reads /proc/cpuinfo. Per-ISA code paths are chosen at
compile time (``csrc/dispatch.h``: one file per instruction set in each family's folder): ``-march=native`` gives
the AVX-512 path on AVX-512 CPUs (AVX512-BF16 dot products where present), the AVX2 + FMA path on AVX2-only CPUs,
and the portable C loops anywhere else; the portable loops are the reference the tests hold the others to. Without
a compiler, or with ``BATCHGEN_CPU_KERNELS=0``, every caller takes its pure-torch path: same results within float
rounding, slower.

Nothing is re-exported here: import the module that defines a name (``engine.kernels.elementwise`` etc.).
"""
