/* Prefill attention (driver.h) with a plain C float32 tile product: the reference. */
#include "../dispatch.h"
#include "../kernels.h"

#if PREFILL_ISA == ISA_PORTABLE
#include <stdint.h>

#define F32_COLS 32
#include "driver.h"

static void f32_gemm_serial(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int M,
                            int N, int K) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += a[(int64_t)m * lda + k] * b[(int64_t)k * ldb + n];
            c[(int64_t)m * ldc + n] = acc;
        }
}

#endif
