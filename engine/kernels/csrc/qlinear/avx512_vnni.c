/* The int8 linear (driver.h) on AVX512-VNNI: vpdpbusd sums four u8 x s8 products into each of 16 int32 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if QLINEAR_ISA == ISA_AVX512_VNNI
#include <immintrin.h>

/* rows per micro-tile: 12 int32 + 12 float accumulators + operands = 27 of 32 zmm */
#define MR 6
#define HAVE_QUANT_GROUP 1
#define HAVE_FUSED 1
#ifndef FUSED_MAX_ROWS
/* calls of at most one tile's rows (decode of a few sequences): at 8-12 rows the two extra vpdpbusd a step cost more than reading ws
 * saves (docs/perf/code-notes-kernels.md); -DFUSED_MAX_ROWS=N overrides it to measure */
#define FUSED_MAX_ROWS MR
#endif
#include "driver.h"

static inline __m512 load16(const void *x, int is_bf16, size_t i) {
    if (is_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}
/* the group as two 16-lane vectors */
static inline void quant_group(const void *x, int is_bf16, size_t i, qact_t *q, float *sa, float *mn) {
    const __m512 a = load16(x, is_bf16, i), b = load16(x, is_bf16, i + 16);
    const float lo = _mm512_reduce_min_ps(_mm512_min_ps(a, b)), hi = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    const float s = (hi - lo) / 255.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    *sa = s;
    *mn = lo;
    const __m512 vlo = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv);
    const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(a, vlo), vinv));
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(b, vlo), vinv));
    qa = _mm512_min_epi32(_mm512_max_epi32(qa, zero), top);
    qb = _mm512_min_epi32(_mm512_max_epi32(qb, zero), top);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
}

/* FUSED: the group sums from two more vpdpbusd (ones x quants) on the weight vectors already loaded, ws unread */
static inline __attribute__((always_inline)) void tile(const int R, const int WIDE, const int FUSED, const qact_t *q,
                                                       int ldq, int Kp, const float *sa, const float *mn,
                                                       const int8_t *w, const uint16_t *sw, const int16_t *ws,
                                                       const int8_t *pf, float acc[MR][32]) {
    (void)WIDE;                                   /* vpdpbusd's int32 sums never saturate */
    const int K4 = Kp / 4, G = Kp / QK;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 f[MR][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i ia[MR][2], ws0 = _mm512_setzero_si512(), ws1 = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm512_setzero_si512();
        /* a constant trip count, unrolled: as a loop from g * 8 GCC copied all twelve int32 accumulators at every
         * step (24 register moves per 12 vpdpbusd); unrolled, the VNNI tile ran faster
         * (docs/perf/code-notes-kernels.md) */
#pragma GCC unroll 8
        for (int u = 0; u < QK / 4; u++) {
            const int k4 = g * (QK / 4) + u;
            const __m512i b0 = _mm512_loadu_si512(w + (size_t)k4 * 64);
            const __m512i b1 = _mm512_loadu_si512(w + ((size_t)K4 + k4) * 64);
            prefetch_line(pf, (size_t)k4 * 64);
            prefetch_line(pf, ((size_t)K4 + k4) * 64);
            if (FUSED) {
                ws0 = _mm512_dpbusd_epi32(ws0, ones, b0);
                ws1 = _mm512_dpbusd_epi32(ws1, ones, b1);
            }
            for (int r = 0; r < R; r++) {
                int32_t a4;
                memcpy(&a4, q + (size_t)r * ldq + k4 * 4, 4);
                const __m512i a = _mm512_set1_epi32(a4);
                ia[r][0] = _mm512_dpbusd_epi32(ia[r][0], a, b0);
                ia[r][1] = _mm512_dpbusd_epi32(ia[r][1], a, b1);
            }
        }
        const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sw + (size_t)g * 16)));
        const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sw + ((size_t)G + g) * 16)));
        if (!FUSED) {
            ws0 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(ws + (size_t)g * 16)));
            ws1 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(ws + ((size_t)G + g) * 16)));
        }
        const __m512 c0 = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(ws0)), c1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(ws1));
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(sa[(size_t)r * G + g]), m = _mm512_set1_ps(mn[(size_t)r * G + g]);
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][0]), _mm512_mul_ps(s0, a), f[r][0]);
            f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][1]), _mm512_mul_ps(s1, a), f[r][1]);
            f[r][0] = _mm512_fmadd_ps(c0, m, f[r][0]);
            f[r][1] = _mm512_fmadd_ps(c1, m, f[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(acc[r], f[r][0]);
        _mm512_storeu_ps(acc[r] + 16, f[r][1]);
    }
}

/* The tiles read q itself, whatever the weights' bound: the int32 sums never saturate. */
static const qact_t *tile_input(const qact_t *q, int M, int Kp, int wmax, int nt, int *wide, int *ldq,
                                qact_t **owned) {
    (void)M;
    (void)wmax;
    (void)nt;
    *owned = NULL;
    *wide = PATH_DIRECT;
    *ldq = Kp;
    return q;
}

#endif
