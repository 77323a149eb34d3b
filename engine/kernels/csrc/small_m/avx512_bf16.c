/* The few-row linear (driver.h) on AVX512-BF16: bf16 rows as vdpbf16ps pair dot products, float32 rows (and bf16
 * blocks under 32 columns) with vec.h's tiles at 16 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_AVX512_BF16
#include "../simd/avx512.h"

#include "driver.h"
#include "vec.h"

static inline __attribute__((always_inline)) int32_t tile_head(const int R, const int C, const void *x, int64_t m0,
                                                               const void *w, int64_t n0, int32_t K, int32_t k0,
                                                               int32_t len, int xb, int wb, float sums[TM][TN]) {
    if (!(xb && wb) || len < 32) return tile_vec(R, C, x, m0, w, n0, K, k0, len, xb, wb, sums);
    int32_t c = 0;
    __m512 acc[TM][TN];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = _mm512_setzero_ps();
    for (; c + 32 <= len; c += 32) {
        __m512bh wv[TN];
        for (int j = 0; j < C; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + (n0 + j) * K + k0 + c);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + (m0 + r) * K + k0 + c);
            for (int j = 0; j < C; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
    return c;
}

#endif
