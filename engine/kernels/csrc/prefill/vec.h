/* prefill's float32 tile product written once with the vf_* of simd/avx2.h or simd/avx512.h: an FMA micro-kernel
 * of 6 rows x F32_COLS (two vectors). Included by avx2.c and avx512.c after driver.h. */
#ifndef BATCHGEN_PREFILL_VEC_H
#define BATCHGEN_PREFILL_VEC_H

#include <stdint.h>

#define F32_ROWS 6   /* 6 x 2 vectors of accumulators */
static inline __attribute__((always_inline)) void f32_micro(const int R, const float *a, int64_t lda, const float *b,
                                                            int64_t ldb, float *c, int64_t ldc, int K) {
    vf acc[F32_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vf_zero();
    for (int k = 0; k < K; k++) {
        const vf b0 = vf_load(b + (int64_t)k * ldb), b1 = vf_load(b + (int64_t)k * ldb + VEC_WIDTH);
        for (int r = 0; r < R; r++) {
            const vf av = vf_set1(a[r * lda + k]);
            acc[r][0] = vf_fma(av, b0, acc[r][0]);
            acc[r][1] = vf_fma(av, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        vf_store(c + r * ldc, acc[r][0]);
        vf_store(c + r * ldc + VEC_WIDTH, acc[r][1]);
    }
}

static void f32_gemm_serial(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int M,
                            int N, int K) {
    for (int n = 0; n < N; n += F32_COLS)
        for (int m = 0; m < M; m += F32_ROWS) {
            const float *am = a + (int64_t)m * lda;
            float *cm = c + (int64_t)m * ldc + n;
            switch (M - m < F32_ROWS ? M - m : F32_ROWS) {   /* constant R: unrolled row loops */
            case 6: f32_micro(6, am, lda, b + n, ldb, cm, ldc, K); break;
            case 5: f32_micro(5, am, lda, b + n, ldb, cm, ldc, K); break;
            case 4: f32_micro(4, am, lda, b + n, ldb, cm, ldc, K); break;
            case 3: f32_micro(3, am, lda, b + n, ldb, cm, ldc, K); break;
            case 2: f32_micro(2, am, lda, b + n, ldb, cm, ldc, K); break;
            default: f32_micro(1, am, lda, b + n, ldb, cm, ldc, K); break;
            }
        }
}

#endif
