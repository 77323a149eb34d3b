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
 * AVX512-BF16 builds: 8 rows x 32 columns per micro-tile (16 accumulators), column edges by mask. Every other
 * build: plain C loops (the reference; slow, so callers use this kernel only where bf16_gemm_fast() is 1).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16_gemm.h"
#include "common.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_GEMM_FAST 1
#else
#define BF16_GEMM_FAST 0
#endif

int bf16_gemm_fast(void) { return BF16_GEMM_FAST; }

#define GR 8     /* rows per micro-tile */
#define GC 32    /* columns per micro-tile: two 16-lane vectors */

static inline uint32_t pair_at(const uint16_t *row, int64_t j) {
    uint32_t w;
    memcpy(&w, row + 2 * j, sizeof w);
    return w;
}

#if BF16_GEMM_FAST
static inline __attribute__((always_inline)) void micro(const int R, const uint16_t *a, int64_t lda,
                                                        const uint32_t *bp, int64_t ldb, float *c, int64_t ldc,
                                                        int K2, __mmask16 m0, __mmask16 m1) {
    __m512 acc[GR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < K2; j++) {
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, bp + (int64_t)j * ldb);
        const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, bp + (int64_t)j * ldb + 16);
        for (int r = 0; r < R; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)pair_at(a + r * lda, j));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
    }
}
#else
static void tile_portable(int R, const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c,
                          int64_t ldc, int K2, int ncols) {
    for (int r = 0; r < R; r++)
        for (int n = 0; n < ncols; n++) {
            float s = 0.0f;
            for (int j = 0; j < K2; j++) {
                const uint32_t av = pair_at(a + r * lda, j), bv = bp[(int64_t)j * ldb + n];
                s += bf16_to_f32((uint16_t)av) * bf16_to_f32((uint16_t)bv)
                     + bf16_to_f32((uint16_t)(av >> 16)) * bf16_to_f32((uint16_t)(bv >> 16));
            }
            c[r * ldc + n] = s;
        }
}
#endif

/* Output tile (rt, ct) (GR rows x GC columns) of c = a @ b. Inlined into both callers: as a plain static
 * function GCC kept it out of line and the whole matmul ran 2.7x slower (measured). */
static inline __attribute__((always_inline)) void tiles(const uint16_t *a, int64_t lda, const uint32_t *bp,
                                                        int64_t ldb, float *c, int64_t ldc, int M, int N, int K2,
                                                        int rt, int ct) {
    const int m = rt * GR, n = ct * GC;
    const int R = M - m < GR ? M - m : GR, ncols = N - n < GC ? N - n : GC;
    const uint16_t *ar = a + (int64_t)m * lda;
    const uint32_t *bc = bp + n;
    float *cr = c + (int64_t)m * ldc + n;
#if BF16_GEMM_FAST
    const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    const __mmask16 m1 = ncols >= 32 ? 0xFFFF : (ncols > 16 ? (__mmask16)((1u << (ncols - 16)) - 1) : 0);
    switch (R) {   /* constant R: the compiler unrolls each case's row loops */
    case 8: micro(8, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 7: micro(7, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 6: micro(6, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 5: micro(5, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 4: micro(4, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 3: micro(3, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    case 2: micro(2, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    default: micro(1, ar, lda, bc, ldb, cr, ldc, K2, m0, m1); break;
    }
#else
    tile_portable(R, ar, lda, bc, ldb, cr, ldc, K2, ncols);
#endif
}

void bf16_gemm_serial(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc,
                      int M, int N, int K2) {
    for (int ct = 0; ct < (N + GC - 1) / GC; ct++)
        for (int rt = 0; rt < (M + GR - 1) / GR; rt++) tiles(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
}

void bf16_gemm(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M,
               int N, int K2, int nt) {
    const int row_tiles = (M + GR - 1) / GR, col_tiles = (N + GC - 1) / GC;
    (void)nt;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt) if ((int64_t)M * N * K2 > 65536)
    for (int ct = 0; ct < col_tiles; ct++)
        for (int rt = 0; rt < row_tiles; rt++) tiles(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
}
