/* The int8 linear (driver.h) on AVX2: vpmaddubsw (u8 x s8, pairs summed into int16) with vpmaddwd by ones into
 * int32, llama.cpp's AVX2 dot product, and three paths by the weights' bound (tile_input). Also what an AVX-512
 * build without VNNI runs. */
#include "../dispatch.h"
#include "../kernels.h"

#if QLINEAR_ISA == ISA_AVX2
#include <immintrin.h>

/* rows per micro-tile: 3 per 16-column pass (6 int32 + 6 float accumulators + 2 weight vectors + activation +
 * ones = 16 ymm; 2 and 4 measured slower on Zen 4) */
#define MR 3
#define HAVE_QUANT_GROUP 1
#define HAVE_WIDE 1
#define HAVE_FUSED 1
#ifndef FUSED_MAX_ROWS
/* one row (decode of one sequence): the sums' int16 accumulators and ones fit beside one row's registers, not three */
#define FUSED_MAX_ROWS 1
#endif
#include "driver.h"

static inline __m256 load8(const void *x, int is_bf16, size_t i) {
    if (is_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}
static inline float hmin8(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
/* the group as four 8-lane vectors */
static inline void quant_group(const void *x, int is_bf16, size_t i, qact_t *q, float *sa, float *mn) {
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = load8(x, is_bf16, i + 8 * j);
    const float lo = hmin8(_mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3])));
    const float hi = hmax8(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    const float s = (hi - lo) / 255.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    *sa = s;
    *mn = lo;
    const __m256 vlo = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv);
    const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
    __m256i h[2];
    for (int j = 0; j < 4; j += 2) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v[j], vlo), vinv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v[j + 1], vlo), vinv));
        a = _mm256_min_epi32(_mm256_max_epi32(a, zero), top);
        b = _mm256_min_epi32(_mm256_max_epi32(b, zero), top);
        /* int32 -> int16 (0..255, no saturation); packs works per 128-bit lane: [a0-7 | b0-7] after vpermq */
        h[j / 2] = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    }
    /* int16 -> uint8 per lane gives qwords a, c, b, d: one more vpermq puts them in order */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packus_epi16(h[0], h[1]), 0xD8));
}

/* One k4 step's operands: a row's 4 activation bytes broadcast to every int32 lane; the block's 8 + 8 columns x 4 k */
static inline __m256i bcast4(const qact_t *p) {
    int32_t a4;
    memcpy(&a4, p, 4);
    return _mm256_set1_epi32(a4);
}
static inline void load_k4(const int8_t *w, int k4, __m256i *b0, __m256i *b1) {
    *b0 = _mm256_loadu_si256((const __m256i *)(w + (size_t)k4 * 64));
    *b1 = _mm256_loadu_si256((const __m256i *)(w + (size_t)k4 * 64 + 32));
}

/* 8 fp16 values as float32 without F16C: f16_to_f32's arithmetic in vector lanes (exact for finite halves) */
static inline __m256 half8(__m128i h) {
    const __m256i x = _mm256_cvtepu16_epi32(h);
    const __m256i bits = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff)), 13);
    const __m256 mag = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p112f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16);
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}

/* The group's 16 fp16 scales as float32: vcvtph2ps where the build has F16C, else half8 (the same values) */
static inline void scales16(const uint16_t *sw, __m256 *s0, __m256 *s1) {
    const __m128i h0 = _mm_loadu_si128((const __m128i *)sw), h1 = _mm_loadu_si128((const __m128i *)(sw + 8));
#ifdef __F16C__
    *s0 = _mm256_cvtph_ps(h0);
    *s1 = _mm256_cvtph_ps(h1);
#else
    *s0 = half8(h0);
    *s1 = half8(h1);
#endif
}

/* The group sums of a fused tile: vpmaddubsw of ones (u8) with the quants (s8) adds k pairs into int16 over the
 * group's eight k4 steps (|sum| <= 8 * 2 * 127, exact); the epilogue's vpmaddwd by ones finishes each column's sum */
static inline void sum_quants(const __m256i b0, const __m256i b1, __m256i z[2]) {
    const __m256i ones8 = _mm256_set1_epi8(1);
    z[0] = _mm256_add_epi16(z[0], _mm256_maddubs_epi16(ones8, b0));
    z[1] = _mm256_add_epi16(z[1], _mm256_maddubs_epi16(ones8, b1));
}

/* One group's float epilogue for R rows x 16 columns: f += dot * sw * sa + cw * mn (cw = sw * ws), with the minimum
 * folded to mn + 128 * sa for WIDE's centred quants (shared by block16 and block16_short). FUSED: the group sums are
 * z's (sum_quants), ws is not read. */
static inline __attribute__((always_inline)) void group_epilogue(const int R, const int WIDE, const int FUSED,
                                                                 __m256i ia[][2], __m256 f[][2], const uint16_t *sw,
                                                                 const int16_t *ws, const __m256i z[2],
                                                                 const float *sa, const float *mn, int G, int g) {
    __m256 s0, s1;
    scales16(sw + (size_t)g * 16, &s0, &s1);
    __m256i i0, i1;
    if (FUSED) {
        const __m256i ones = _mm256_set1_epi16(1);
        i0 = _mm256_madd_epi16(z[0], ones);
        i1 = _mm256_madd_epi16(z[1], ones);
    } else {
        i0 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(ws + (size_t)g * 16)));
        i1 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(ws + (size_t)g * 16 + 8)));
    }
    const __m256 c0 = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(i0)), c1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(i1));
    for (int r = 0; r < R; r++) {
        const float sr = sa[(size_t)r * G + g], mr = mn[(size_t)r * G + g];
        const __m256 a = _mm256_set1_ps(sr), m = _mm256_set1_ps(WIDE ? fmaf(128.0f, sr, mr) : mr);
        f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][0]), _mm256_mul_ps(s0, a), f[r][0]);
        f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][1]), _mm256_mul_ps(s1, a), f[r][1]);
        f[r][0] = _mm256_fmadd_ps(c0, m, f[r][0]);
        f[r][1] = _mm256_fmadd_ps(c1, m, f[r][1]);
    }
}

static inline __attribute__((always_inline)) void store16(const int R, __m256 f[][2], float acc[MR][32], int row,
                                                          int col) {
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc[row + r] + col, f[r][0]);
        _mm256_storeu_ps(acc[row + r] + col + 8, f[r][1]);
    }
}

/* One 16-column block, R rows: per k4 step the block's 64 weight bytes are two ymm of 8 columns x 4 k, and one
 * broadcast 4-byte activation meets each; vpmaddubsw gives int16 sums of k pairs and vpmaddwd by ones widens each
 * column's two pair sums into its int32 lane, so the lanes are the 8 columns directly.
 *   WIDE 0 (max|w| <= 64, e.g. the default GGUF's exact Q5_0 tensors): vpmaddubsw(q, w), pair sums <= 2 * 255 * 64.
 *   WIDE 1 (any weights): q holds per row |c| then c for the centred quants c = q - 128 (centre_rows), and
 *          vpmaddubsw(|c|, sign(c) * w) keeps pair sums <= 2 * 128 * 127; the minimum becomes mn + 128 * sa.
 * Both are below int16's 32767: exact. WIDE 1 costs a vpsignb per product (measured ~1.5x slower on Zen 4). */
static inline __attribute__((always_inline)) void block16(const int R, const int WIDE, const int FUSED,
                                                          const qact_t *q, int ldq, int Kp, const float *sa,
                                                          const float *mn, const int8_t *w, const uint16_t *sw,
                                                          const int16_t *ws, const int8_t *pf, float acc[MR][32],
                                                          int col) {
    const int G = Kp / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[MR][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i ia[MR][2], z[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
        for (int k4 = g * (QK / 4); k4 < (g + 1) * (QK / 4); k4++) {
            __m256i b0, b1;
            load_k4(w, k4, &b0, &b1);
            prefetch_line(pf, (size_t)k4 * 64);
            if (FUSED) sum_quants(b0, b1, z);
            for (int r = 0; r < R; r++) {
                const __m256i a = bcast4(q + (size_t)r * ldq + k4 * 4);
                __m256i p0, p1;
                if (WIDE) {
                    const __m256i c = bcast4(q + (size_t)r * ldq + Kp + k4 * 4);
                    p0 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(b0, c));
                    p1 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(b1, c));
                } else {
                    p0 = _mm256_maddubs_epi16(a, b0);
                    p1 = _mm256_maddubs_epi16(a, b1);
                }
                ia[r][0] = _mm256_add_epi32(ia[r][0], _mm256_madd_epi16(p0, ones));
                ia[r][1] = _mm256_add_epi32(ia[r][1], _mm256_madd_epi16(p1, ones));
            }
        }
        group_epilogue(R, WIDE, FUSED, ia, f, sw, ws, z, sa, mn, G, g);
    }
    store16(R, f, acc, 0, col);
}

/* SHORT (max|w| <= 16: the default GGUF's Q5_0 tensors, q5 - 16): vpmaddubsw's pair sums are within 2 * 255 * 16
 * = 8160, so four k4 steps add up in int16 (<= 32640, exact) before one vpmaddwd widens them: a quarter of WIDE 0's
 * vpmaddwd + vpaddd. Each output vector then needs three registers (float, int32, int16 sums), so at most two rows
 * per pass (6 x 2 + two weight vectors + the activation = 15 ymm; the ones are a memory operand). */
static inline __attribute__((always_inline)) void block16_short(const int R, const int FUSED, const qact_t *q,
                                                                int ldq, int Kp, const float *sa, const float *mn,
                                                                const int8_t *w, const uint16_t *sw,
                                                                const int16_t *ws, const int8_t *pf,
                                                                float acc[MR][32], int row, int col) {
    static const int16_t ONES[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int G = Kp / QK;
    __m256 f[2][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i ia[2][2], z[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int half = 0; half < 2; half++) {
            __m256i s[2][2];
            for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            const int k0 = g * (QK / 4) + half * 4;
            for (int k4 = k0; k4 < k0 + 4; k4++) {
                __m256i b0, b1;
                load_k4(w, k4, &b0, &b1);
                prefetch_line(pf, (size_t)k4 * 64);
                if (FUSED) sum_quants(b0, b1, z);
                for (int r = 0; r < R; r++) {
                    const __m256i a = bcast4(q + (size_t)r * ldq + k4 * 4);
                    s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(a, b0));
                    s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(a, b1));
                }
            }
            const __m256i ones = _mm256_load_si256((const __m256i *)ONES);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 2; j++) {
                    const __m256i wide = _mm256_madd_epi16(s[r][j], ones);
                    ia[r][j] = half ? _mm256_add_epi32(ia[r][j], wide) : wide;
                }
        }
        group_epilogue(R, 0, FUSED, ia, f, sw, ws, z, sa, mn, G, g);
    }
    store16(R, f, acc, row, col);
}

/* WIDE: PATH_DIRECT, PATH_SIGN (the sign trick) or PATH_SHORT (int16 sums over four k4 steps, two rows at a time);
 * FUSED: the group sums from the quants (sum_quants), ws unread */
static inline __attribute__((always_inline)) void tile(const int R, const int WIDE, const int FUSED, const qact_t *q,
                                                       int ldq, int Kp, const float *sa, const float *mn,
                                                       const int8_t *w, const uint16_t *sw, const int16_t *ws,
                                                       const int8_t *pf, float acc[MR][32]) {
    const int K4 = Kp / 4, G = Kp / QK;
    if (WIDE == PATH_SHORT) {
        for (int c = 0; c < 2; c++) {
            const int8_t *wc = w + (size_t)c * K4 * 64, *pfc = pf ? pf + (size_t)c * K4 * 64 : NULL;
            const uint16_t *swc = sw + (size_t)c * G * 16;
            const int16_t *wsc = ws + (size_t)c * G * 16;
            for (int r0 = 0; r0 < R; r0 += 2) {
                const qact_t *qr = q + (size_t)r0 * ldq;
                const float *sar = sa + (size_t)r0 * G, *mnr = mn + (size_t)r0 * G;
                const int8_t *p = r0 == 0 ? pfc : NULL;   /* the block's first pass fetches the next one's */
                if (R - r0 >= 2) block16_short(2, FUSED, qr, ldq, Kp, sar, mnr, wc, swc, wsc, p, acc, r0, 16 * c);
                else block16_short(1, FUSED, qr, ldq, Kp, sar, mnr, wc, swc, wsc, p, acc, r0, 16 * c);
            }
        }
        return;
    }
    block16(R, WIDE, FUSED, q, ldq, Kp, sa, mn, w, sw, ws, pf, acc, 0);
    block16(R, WIDE, FUSED, q, ldq, Kp, sa, mn, w + (size_t)K4 * 64, sw + (size_t)G * 16, ws + (size_t)G * 16,
            pf ? pf + (size_t)K4 * 64 : NULL, acc, 16);
}

/* WIDE's activation rows: [|q - 128| (Kp bytes) | q - 128 as int8 (Kp bytes)] per row; malloc'd, caller frees. */
static qact_t *centre_rows(const qact_t *q, int M, int Kp, int nt) {
    qact_t *out = (qact_t *)malloc((size_t)M * 2 * Kp);
#pragma omp parallel for schedule(static) num_threads(nt) if ((int64_t)M * Kp >= QUANT_PAR_MIN)
    for (int m = 0; m < M; m++) {
        qact_t *u = out + (size_t)m * 2 * Kp, *c = u + Kp;
        const qact_t *src = q + (size_t)m * Kp;
        for (int k = 0; k < Kp; k++) {
            const int v = (int)src[k] - 128;
            u[k] = (qact_t)(v < 0 ? -v : v);
            c[k] = (qact_t)(int8_t)v;
        }
    }
    return out;
}

/* By the weights' bound: within +-16 PATH_SHORT and within +-64 PATH_DIRECT over q itself (row stride Kp); beyond
 * that PATH_SIGN over the centred rows (stride 2 Kp, malloc'd: *owned is set and the caller frees it). */
static const qact_t *tile_input(const qact_t *q, int M, int Kp, int wmax, int nt, int *wide, int *ldq,
                                qact_t **owned) {
    *owned = NULL;
    *wide = PATH_DIRECT;
    *ldq = Kp;
    if (wmax <= 16) {
        *wide = PATH_SHORT;
        return q;
    }
    if (wmax > 64) {
        *owned = centre_rows(q, M, Kp, nt);
        *wide = PATH_SIGN;
        *ldq = 2 * Kp;
        return *owned;
    }
    return q;
}

#endif
