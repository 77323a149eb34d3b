/* bf16_gemm (driver.h) on AVX512-BF16: vdpbf16ps, per lane acc += a0 * b0 + a1 * b1 over bf16 pairs. */
#include "../dispatch.h"
#include "../kernels.h"

#if BF16_GEMM_ISA == ISA_AVX512_BF16
#include <immintrin.h>
#include <stdint.h>

#define GR 8     /* rows per micro-tile */
#define GC 32    /* columns per micro-tile: two 16-lane vectors */
#if BF16_GEMM_AMX
#define HAVE_AMX_TILES 1
#include "amx_tiles.h"
#include "amx_flash.h"
#endif
#include "driver.h"

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

static inline __attribute__((always_inline)) void tiles(const uint16_t *a, int64_t lda, const uint32_t *bp,
                                                        int64_t ldb, float *c, int64_t ldc, int M, int N, int K2,
                                                        int rt, int ct) {
    const int m = rt * GR, n = ct * GC;
    const int R = M - m < GR ? M - m : GR, ncols = N - n < GC ? N - n : GC;
    const uint16_t *ar = a + (int64_t)m * lda;
    const uint32_t *bc = bp + n;
    float *cr = c + (int64_t)m * ldc + n;
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
}

#endif
