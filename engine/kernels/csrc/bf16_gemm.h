/* bf16 x bf16 -> float32 matmul (bf16_gemm.c), for the kernels that call it on one thread (prefill.c). */
#ifndef BATCHGEN_BF16_GEMM_H
#define BATCHGEN_BF16_GEMM_H

#include <stdint.h>

/* c[M, N] = a[M, 2 K2] @ b, b packed in pairs along K (bp[j * ldb + n] = (b[2j][n], b[2j+1][n])): the layouts of
 * bf16_gemm, computed on the calling thread. */
void bf16_gemm_serial(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc,
                      int M, int N, int K2);

#endif
