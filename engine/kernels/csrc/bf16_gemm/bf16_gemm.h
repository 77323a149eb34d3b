/* c[M, N] (float32) = a[M, K] (bf16) @ b[K, N] (bf16, packed in pairs along K), float32 accumulation and a
 * float32 result: the two products of a bf16 prefill attention tile (scores = q k^T, out = p v).
 *
 * Why: torch's bf16 matmul on the CPU returns bf16, so a bf16 attention tile rounds its scores to 8 significant
 * bits before the softmax (an error of ~0.03-0.1 in a logit of 10-30) and its output again before o_proj. With
 * float32 activations and a bf16 KV cache (int8 weights + ``kv_cache_dtype: bfloat16``) those two roundings were
 * most of the cache's cost against float32 (KL +18 % where rounding only K, V, q and p costs ~2 %). Here the
 * products stay float32.
 *
 * Layouts:
 *   a   row m at a + m * lda (bf16; the pair (a[m][2j], a[m][2j+1]) is read as one 32-bit word: K2 = K / 2 pairs,
 *       K even, zero-padded by the caller)
 *   bp  [K2, ldb] 32-bit words: bp[j * ldb + n] = (b[2j][n], b[2j+1][n]) as two bf16, columns n < N used
 *   c   row m at c + m * ldc, float32, overwritten
 * which is the operand shape of vdpbf16ps (per lane: acc += a0 * b0 + a1 * b1).
 *
 * avx512_bf16.c: 8 rows x 32 columns per micro-tile (16 accumulators), column edges by mask. portable.c, every
 * other build: plain C loops (the reference; slow, so callers use this kernel only where bf16_gemm_fast() is 1).
 *
 * This header declares what prefill/ calls; driver.h is what the implementations share.
 */
#ifndef BATCHGEN_BF16_GEMM_H
#define BATCHGEN_BF16_GEMM_H

#include <stdint.h>
#include <string.h>

/* c[M, N] = a[M, 2 K2] @ b, b packed in pairs along K (bp[j * ldb + n] = (b[2j][n], b[2j+1][n])): bf16_gemm
 * computed on the calling thread (prefill's tiles). */
void bf16_gemm_serial(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc,
                      int M, int N, int K2);

/* 1 where this process runs bf16 products on AMX tiles (bf16_gemm_amx; BATCHGEN_AMX=0 keeps them off): the decode
 * attention's scores ask it too (paged_decode/avx512_bf16.c) */
int bf16_gemm_tiles_on(void);

/* One prefill work item's attention on AMX tiles with the softmax online (amx_flash.h): ob [rows, D] float32 for
 * qt's rows (bf16, row r at query position ts + r / G) over one KV head's packed keys kp [D/2, ldk] and values
 * vp [S/2, D], key j at position k_start + j (k_start an absolute multiple of 32). Returns 0, writing nothing, where
 * it does not run (no tiles, or D not a multiple of 64 up to 256): the caller takes the two-product path. */
int bf16_attention_amx(const uint16_t *qt, int rows, int G, int64_t ts, const uint32_t *kp, int64_t ldk,
                       const uint32_t *vp, int S, int D, int64_t k_start, int64_t window, float *ob);

/* the pair (row[2j], row[2j+1]) as one 32-bit word */
static inline uint32_t pair_at(const uint16_t *row, int64_t j) {
    uint32_t w;
    memcpy(&w, row + 2 * j, sizeof w);
    return w;
}

#endif
