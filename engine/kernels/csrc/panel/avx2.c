/* The panel linear (driver.h) on AVX2 + FMA (an AVX-512 build too): a tile of R x rows by one panel, 2 x R
 * float32 accumulators of 8 lanes in registers, each x value broadcast into both halves of the panel's row. */
#include "../dispatch.h"
#include "../kernels.h"

#if PANEL_ISA == ISA_AVX2
#include <immintrin.h>

#include "driver.h"

/* a panel row's 16 values as two float32 vectors: rows 0-7 and 8-15 */
static inline __attribute__((always_inline)) void panel_load(const void *p, int pb, int32_t k, __m256 *w0,
                                                             __m256 *w1) {
    if (pb) {                  /* PANEL_SLOT's order: bf16 slots 0-3, 8-11 widen to rows 0-7, slots 4-7, 12-15 to 8-15 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + (int64_t)k * PANEL_NR));
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
    } else {
        *w0 = _mm256_loadu_ps((const float *)p + (int64_t)k * PANEL_NR);
        *w1 = _mm256_loadu_ps((const float *)p + (int64_t)k * PANEL_NR + 8);
    }
}

static inline __attribute__((always_inline)) void out(float *y, __m256 lo, __m256 hi, int ncols) {
    if (ncols == PANEL_NR) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    float t[PANEL_NR];
    _mm256_storeu_ps(t, lo);
    _mm256_storeu_ps(t + 8, hi);
    memcpy(y, t, (size_t)ncols * sizeof(float));
}

/* y's 16 values (ncols of them; the rest zero) as two vectors: a chain continued from the previous block */
static inline __attribute__((always_inline)) void into(const float *y, __m256 *lo, __m256 *hi, int ncols) {
    if (ncols == PANEL_NR) {
        *lo = _mm256_loadu_ps(y);
        *hi = _mm256_loadu_ps(y + 8);
        return;
    }
    float t[PANEL_NR] = {0};
    memcpy(t, y, (size_t)ncols * sizeof(float));
    *lo = _mm256_loadu_ps(t);
    *hi = _mm256_loadu_ps(t + 8);
}

/* named accumulators (an array of them is kept in memory by GCC) */
static inline __attribute__((always_inline)) void panel_tile(const int R, const float *x, int32_t K, int32_t k0,
                                                             int32_t kc, const void *p, int pb, float *y, int64_t N,
                                                             int64_t n0, int ncols, int first) {
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
    if (!first) {
        if (R > 0) into(y + 0 * N + n0, &a00, &a01, ncols);
        if (R > 1) into(y + 1 * N + n0, &a10, &a11, ncols);
        if (R > 2) into(y + 2 * N + n0, &a20, &a21, ncols);
        if (R > 3) into(y + 3 * N + n0, &a30, &a31, ncols);
        if (R > 4) into(y + 4 * N + n0, &a40, &a41, ncols);
        if (R > 5) into(y + 5 * N + n0, &a50, &a51, ncols);
    }
    /* four columns a trip: the loop's own instructions out of the FMA pipes' way (6-row tiles 79 -> 86 GFLOP/s a
     * core on Zen 3, whose FMA peak is 100) */
#pragma GCC unroll 4
    for (int32_t k = k0; k < k0 + kc; k++) {
        __m256 w0, w1;
        panel_load(p, pb, k, &w0, &w1);
        if (R > 0) { const __m256 b = _mm256_broadcast_ss(x + 0 * (int64_t)K + k); a00 = _mm256_fmadd_ps(b, w0, a00); a01 = _mm256_fmadd_ps(b, w1, a01); }
        if (R > 1) { const __m256 b = _mm256_broadcast_ss(x + 1 * (int64_t)K + k); a10 = _mm256_fmadd_ps(b, w0, a10); a11 = _mm256_fmadd_ps(b, w1, a11); }
        if (R > 2) { const __m256 b = _mm256_broadcast_ss(x + 2 * (int64_t)K + k); a20 = _mm256_fmadd_ps(b, w0, a20); a21 = _mm256_fmadd_ps(b, w1, a21); }
        if (R > 3) { const __m256 b = _mm256_broadcast_ss(x + 3 * (int64_t)K + k); a30 = _mm256_fmadd_ps(b, w0, a30); a31 = _mm256_fmadd_ps(b, w1, a31); }
        if (R > 4) { const __m256 b = _mm256_broadcast_ss(x + 4 * (int64_t)K + k); a40 = _mm256_fmadd_ps(b, w0, a40); a41 = _mm256_fmadd_ps(b, w1, a41); }
        if (R > 5) { const __m256 b = _mm256_broadcast_ss(x + 5 * (int64_t)K + k); a50 = _mm256_fmadd_ps(b, w0, a50); a51 = _mm256_fmadd_ps(b, w1, a51); }
    }
    if (R > 0) out(y + 0 * N + n0, a00, a01, ncols);
    if (R > 1) out(y + 1 * N + n0, a10, a11, ncols);
    if (R > 2) out(y + 2 * N + n0, a20, a21, ncols);
    if (R > 3) out(y + 3 * N + n0, a30, a31, ncols);
    if (R > 4) out(y + 4 * N + n0, a40, a41, ncols);
    if (R > 5) out(y + 5 * N + n0, a50, a51, ncols);
}

#endif
