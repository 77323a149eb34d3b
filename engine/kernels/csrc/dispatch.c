/* What this build runs: the implementations dispatch.h chose, as the Python side reads them
 * (engine.kernels.library). */
#include "dispatch.h"
#include "kernels.h"

/* the float32 vector paths, with bf16 dot products where the build has them */
#if BF16_DOT_ISA == ISA_AVX512_BF16
#define KERNEL_ISA "avx512_bf16"
#elif VEC_ISA == ISA_AVX512
#define KERNEL_ISA "avx512"
#elif VEC_ISA == ISA_AVX2
#define KERNEL_ISA "avx2"
#else
#define KERNEL_ISA "portable"
#endif

#if QLINEAR_ISA == ISA_AVX512_VNNI
#define KERNEL_Q8_ISA "avx512_vnni"
#elif QLINEAR_ISA == ISA_AVX2
#define KERNEL_Q8_ISA "avx2"
#else
#define KERNEL_Q8_ISA "portable"
#endif

/* the cache key of this build (build.py passes it); the loader checks it names the file it loaded */
#ifndef BATCHGEN_BUILD_ID
#define BATCHGEN_BUILD_ID "unset"
#endif

const char *batchgen_build_id(void) { return BATCHGEN_BUILD_ID; }

const char *batchgen_kernel_isa(void) { return KERNEL_ISA; }

const char *batchgen_q8_isa(void) { return KERNEL_Q8_ISA; }

int bf16_gemm_fast(void) { return BF16_GEMM_ISA == ISA_AVX512_BF16; }
