/* Which implementation of each kernel family this build compiles, read from the compile flags (-march=native, or
 * BATCHGEN_KERNEL_FLAGS: engine/kernels/build.py). This is the one place that tests the target's instruction-set
 * macros (__AVX2__, __AVX512F__, ...).
 *
 * A family with instruction-set-specific code keeps it in csrc/<family>/, one file per instruction set, named
 * after it: portable.c, avx2.c, avx512.c, avx512_bf16.c, avx512_vnni.c. Each file's code sits inside
 * `#if <FAMILY>_ISA == ISA_<NAME>`, so exactly one file per family compiles to code in any build: it defines
 * the family's exported functions (kernels.h); the other files compile to nothing.
 *
 *   family         file chosen, by what the build has
 *   paged_decode   avx512_bf16 (AVX512-BF16), avx512 (AVX-512F), avx2 (AVX2 + FMA), else portable
 *   small_m        avx512_bf16 (AVX512-BF16), avx512 (AVX-512F), avx2 (AVX2 + FMA), else portable
 *   prefill        avx512 (AVX-512F), avx2 (AVX2 + FMA), else portable
 *   panel          avx2 (AVX2 + FMA: an AVX-512 build too), else portable
 *   bf16_gemm      avx512_bf16 (AVX512-BF16; with AMX-BF16 its tiles where the process may use them:
 *                  amx_tiles.h), else portable
 *   qlinear        avx512_vnni (AVX512-VNNI + AVX512-BW; with AMX-BF16 its prompt rows' path on tiles:
 *                  amx_prompt.h), avx2 (AVX2: an AVX-512 build without VNNI too), else portable
 *
 * The families without instruction-set-specific code (elementwise.c, kv_write.c, masked_softmax.c, ngram.c,
 * q8_embed.c) are plain C that the compiler vectorizes for whatever the flags allow.
 */
#ifndef BATCHGEN_DISPATCH_H
#define BATCHGEN_DISPATCH_H

#define ISA_PORTABLE 0
#define ISA_AVX2 1
#define ISA_AVX512 2
#define ISA_AVX512_BF16 3
#define ISA_AVX512_VNNI 4

/* float32 vectors with fused multiply-add (simd/avx512.h: 16 lanes, simd/avx2.h: 8) */
#if defined(__AVX512F__)
#define VEC_ISA ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_ISA ISA_AVX2
#else
#define VEC_ISA ISA_PORTABLE
#endif

/* bf16 pair dot products (vdpbf16ps) */
#if defined(__AVX512BF16__)
#define BF16_DOT_ISA ISA_AVX512_BF16
#else
#define BF16_DOT_ISA VEC_ISA
#endif

#define PAGED_DECODE_ISA BF16_DOT_ISA
#define SMALL_M_ISA BF16_DOT_ISA
#define PREFILL_ISA VEC_ISA

#if defined(__AVX2__) && defined(__FMA__)
#define PANEL_ISA ISA_AVX2
#else
#define PANEL_ISA ISA_PORTABLE
#endif

#if defined(__AVX512BF16__)
#define BF16_GEMM_ISA ISA_AVX512_BF16
#else
#define BF16_GEMM_ISA ISA_PORTABLE
#endif
/* AMX-BF16 tiles inside the avx512_bf16 build (bf16_gemm/amx_tiles.h), where the process may use them */
#if BF16_GEMM_ISA == ISA_AVX512_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BF16_GEMM_AMX 1
#else
#define BF16_GEMM_AMX 0
#endif

/* int8 dot products: vpdpbusd (u8 x s8 summed four at a time into int32) or AVX2's vpmaddubsw */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QLINEAR_ISA ISA_AVX512_VNNI
#elif defined(__AVX2__)
#define QLINEAR_ISA ISA_AVX2
#else
#define QLINEAR_ISA ISA_PORTABLE
#endif
/* the int8 linear's prompt rows on AMX-BF16 tiles (qlinear/amx_prompt.h), inside the avx512_vnni build */
#if QLINEAR_ISA == ISA_AVX512_VNNI && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QLINEAR_AMX_BF16 1
#else
#define QLINEAR_AMX_BF16 0
#endif

#endif
