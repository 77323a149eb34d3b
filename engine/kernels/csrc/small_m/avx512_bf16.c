/* The few-row linear (driver.h) on AVX512-BF16: bf16 rows as vdpbf16ps pair dot products, float32 rows (and bf16
 * rows under 32 columns) with vec.h's dots at 16 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_AVX512_BF16
#include "../simd/avx512.h"

#include "driver.h"
#include "vec.h"

static inline __attribute__((always_inline)) int32_t dots_head(const int R, const void *x, int64_t m0, int32_t K,
                                                               const void *wr, int is_bf16, float *sums) {
    int32_t c = 0;
    if (is_bf16) {
        __m512 acc[RB];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (; c + 32 <= K; c += 32) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)wr + c);
            for (int r = 0; r < R; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + (m0 + r) * K + c);
                acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
            }
        }
        for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
    }
    if (c == 0) c = dots_vec(R, x, m0, K, wr, is_bf16, sums);
    return c;
}

#endif
