/* bf16_gemm (driver.h) in plain C loops: the reference. */
#include "../dispatch.h"
#include "../kernels.h"

#if BF16_GEMM_ISA == ISA_PORTABLE
#include <stdint.h>

#include "../common.h"

#define GR 8     /* rows per micro-tile */
#define GC 32    /* columns per micro-tile: two 16-lane vectors */
#include "driver.h"

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

static inline __attribute__((always_inline)) void tiles(const uint16_t *a, int64_t lda, const uint32_t *bp,
                                                        int64_t ldb, float *c, int64_t ldc, int M, int N, int K2,
                                                        int rt, int ct) {
    const int m = rt * GR, n = ct * GC;
    const int R = M - m < GR ? M - m : GR, ncols = N - n < GC ? N - n : GC;
    const uint16_t *ar = a + (int64_t)m * lda;
    const uint32_t *bc = bp + n;
    float *cr = c + (int64_t)m * ldc + n;
    tile_portable(R, ar, lda, bc, ldb, cr, ldc, K2, ncols);
}

#endif
