/* Int8 linear layers: y = x @ W^T with W in int8 (per row, per group of 32 along K, one float32 scale:
 * llama.cpp's Q8_0 grouping) and x quantized on the fly to uint8 per token and group of 32, asymmetric
 * (a scale and the group minimum: x ~= sa * q + mn). Asymmetric activations matter: GeGLU outputs are
 * skewed, and symmetric int8 doubled the model's KL divergence against float32 (measured on gemma-3-270m).
 *
 * Per output (m, n):  y = sum_g  sw[n,g] * sa[m,g] * dot_g(q[m], W[n])  +  mn[m,g] * cw[n,g]
 * where dot_g is an exact int32 dot product over the group and cw[n,g] = sw[n,g] * sum_k W[n,k] (precomputed
 * at packing). The integer dot products run on the best unit the build targets (KERNEL_Q8_ISA):
 *
 *   "avx512_vnni"  vpdpbusd: u8 x s8, four products summed into each int32 lane, 16 lanes
 *   "avx2"         vpmaddubsw (u8 x s8, pairs summed into int16) with vpmaddwd by ones into int32, llama.cpp's
 *                  AVX2 dot product. Its int16 pair sums would saturate for u8 255 x s8 127, so weights within
 *                  +-64 (wmax, the callers' bound) are multiplied directly (pair sums <= 2 * 255 * 64), and wider
 *                  ones by the centred quants: |q - 128| (<= 128) times sign(q - 128) * w (vpsignb), pair sums
 *                  <= 2 * 128 * 127, with the minimum folded to mn + 128 * sa (block16: WIDE). Weights within
 *                  +-16 (the default GGUF's Q5_0 tensors) add four steps' pair sums in int16 before one vpmaddwd
 *                  (block16_short).
 *   "portable"     plain C loops over the same packed layout: the reference the others are tested against
 *
 * Packed weight layout (Np = N rounded up to 32, Kp = K rounded up to 32, K4 = Kp / 4, G = Kp / 32):
 *   w [(nb * K4 + k4) * 64 + lane * 4 + j] = W[nb * 16 + lane][k4 * 4 + j]       (int8, zero padding)
 *   sw[(nb * G + g) * 16 + lane], cw[(nb * G + g) * 16 + lane]                      (float32)
 * so one 64-byte load gives 16 output columns x 4 consecutive k, the operand shape of vpdpbusd.
 * Activations: q[m * Kp + k] (uint8, every build), sa/mn[m * G + g].
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"
#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KERNEL_Q8_ISA "avx512_vnni"
typedef uint8_t qact_t;
#elif defined(__AVX2__)
#include <immintrin.h>
#define KERNEL_Q8_ISA "avx2"
#else
#define KERNEL_Q8_ISA "portable"
#endif
typedef uint8_t qact_t;

#define QK 32          /* group size along K */
/* the avx2 build's dot-product paths by weight bound (tile_input): within +-16, within +-64, any weights; the
 * other builds always take PATH_DIRECT */
enum { PATH_DIRECT = 0, PATH_SIGN = 1, PATH_SHORT = 2 };
/* rows per micro-tile: VNNI 6 (12 int32 + 12 float accumulators + operands = 27 of 32 zmm); AVX2 3 per
 * 16-column pass (6 int32 + 6 float accumulators + 2 weight vectors + activation + ones = 16 ymm; 2 and 4
 * measured slower on Zen 4) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MR 6
#elif defined(__AVX2__)
#define MR 3
#else
#define MR 4
#endif
#define MC (MR * 10)   /* rows per work item (they stay in L1/L2 while the weight blocks stream past) */

const char *batchgen_q8_isa(void) { return KERNEL_Q8_ISA; }

/* ---- activation quantization: one row, asymmetric, per group of 32 --------------------------------- */

static inline float load_x(const void *x, int is_bf16, size_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* One whole group of 32 (k0 + 32 <= K) in vector registers: the same values as the scalar loop below (min and
 * max are exact, (x - lo) * inv is the same float arithmetic, and vcvtps2dq rounds to nearest even like lrintf
 * under the default rounding mode); tests compare every build's quants with the portable build's. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512 load16(const void *x, int is_bf16, size_t i) {
    if (is_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}
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
#define HAVE_QUANT_GROUP 1
#elif defined(__AVX2__)
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
#define HAVE_QUANT_GROUP 1
#endif

static void quant_row(const void *x, int is_bf16, size_t off, int K, int Kp, qact_t *q, float *sa, float *mn) {
    for (int g = 0; g * QK < Kp; g++) {
        const int k0 = g * QK, k1 = k0 + QK < K ? k0 + QK : K;
#ifdef HAVE_QUANT_GROUP
        if (k1 - k0 == QK) {
            quant_group(x, is_bf16, off + k0, q + k0, sa + g, mn + g);
            continue;
        }
#endif
        float lo = 0.0f, hi = 0.0f;
        if (k0 < K) {
            lo = hi = load_x(x, is_bf16, off + k0);
            for (int k = k0 + 1; k < k1; k++) {
                const float v = load_x(x, is_bf16, off + k);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
        }
        const float s = (hi - lo) / 255.0f;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        sa[g] = s;
        mn[g] = lo;
        for (int k = k0; k < k0 + QK; k++) {
            int v = 0;
            if (k < K) {
                v = (int)lrintf((load_x(x, is_bf16, off + k) - lo) * inv);
                v = v < 0 ? 0 : (v > 255 ? 255 : v);
            }
            q[k] = (qact_t)v;
        }
    }
}

static void quant_act(const void *x, int is_bf16, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn,
                      int nt) {
    const int G = Kp / QK;
#pragma omp parallel for schedule(static) num_threads(nt) if (M > 8)
    for (int m = 0; m < M; m++)
        quant_row(x, is_bf16, (size_t)m * ldx, K, Kp, q + (size_t)m * Kp, sa + (size_t)m * G, mn + (size_t)m * G);
}

void q8_quant_act_f32(const float *x, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn, int nt) {
    quant_act(x, 0, M, K, ldx, Kp, q, sa, mn, nt);
}
void q8_quant_act_bf16(const uint16_t *x, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn, int nt) {
    quant_act(x, 1, M, K, ldx, Kp, q, sa, mn, nt);
}

/* ---- store one tile row of 32 float results (fewer at the right edge) --------------------------------- */

static inline void store_row(const float *acc, void *out, int is_bf16, size_t off, int ncols) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out + off;
        for (int j = 0; j < ncols; j++) o[j] = f32_to_bf16(acc[j]);
    } else {
        float *o = (float *)out + off;
        for (int j = 0; j < ncols; j++) o[j] = acc[j];
    }
}

/* ---- the gated MLP's gate_up projection with its GLU fused in ------------------------------------------
 * With the weight rows interleaved in blocks of 16 (gate rows 16b..16b+15, then up rows 16b..16b+15: a tile's two
 * 16-column blocks; engine.quant.int8.glu_interleave), a tile's 32 results per row are 16 gates and their 16 ups,
 * and out[m, 16 * pair + j] = act(gate_j) * up_j is written instead of the [M, 2I] gate_up product: the GLU's
 * read-back of that product and its separate pass are gone. A bf16 output rounds gate and up to bf16 first, as
 * the unfused path (q8_linear_bf16, then elementwise.c's GLU on its bf16 output) does: the same bits either way. */
enum { GLU_NONE = 0, GLU_GELU_TANH = 1, GLU_SILU = 2 };

static inline float as_stored(float x, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline void store_glu(const float *acc, void *out, int is_bf16, size_t off, int act) {
    float o[16];
    if (act == GLU_SILU) {
#pragma omp simd
        for (int j = 0; j < 16; j++) o[j] = silu(as_stored(acc[j], is_bf16)) * as_stored(acc[16 + j], is_bf16);
    } else {
#pragma omp simd
        for (int j = 0; j < 16; j++) o[j] = gelu_tanh(as_stored(acc[j], is_bf16)) * as_stored(acc[16 + j], is_bf16);
    }
    store_row(o, out, is_bf16, off, 16);
}

/* ---- micro-kernels: R (<= MR) rows x 32 columns (two 16-column weight blocks), all of K ------------------ */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

static inline __attribute__((always_inline)) void tile(const int R, const int WIDE, const qact_t *q, int ldq,
                                                       int Kp, const float *sa, const float *mn, const int8_t *w,
                                                       const float *sw, const float *cw, float acc[MR][32]) {
    (void)WIDE;                                   /* vpdpbusd's int32 sums never saturate */
    const int K4 = Kp / 4, G = Kp / QK;
    __m512 f[MR][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i ia[MR][2];
        for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm512_setzero_si512();
        /* a constant trip count, unrolled: as a loop from g * 8 GCC copied all twelve int32 accumulators at every
         * step (24 register moves per 12 vpdpbusd); unrolled, the VNNI tile ran faster (docs/perf/code-notes-kernels.md) */
#pragma GCC unroll 8
        for (int u = 0; u < QK / 4; u++) {
            const int k4 = g * (QK / 4) + u;
            const __m512i b0 = _mm512_loadu_si512(w + (size_t)k4 * 64);
            const __m512i b1 = _mm512_loadu_si512(w + ((size_t)K4 + k4) * 64);
            for (int r = 0; r < R; r++) {
                int32_t a4;
                memcpy(&a4, q + (size_t)r * ldq + k4 * 4, 4);
                const __m512i a = _mm512_set1_epi32(a4);
                ia[r][0] = _mm512_dpbusd_epi32(ia[r][0], a, b0);
                ia[r][1] = _mm512_dpbusd_epi32(ia[r][1], a, b1);
            }
        }
        const __m512 s0 = _mm512_loadu_ps(sw + (size_t)g * 16), s1 = _mm512_loadu_ps(sw + ((size_t)G + g) * 16);
        const __m512 c0 = _mm512_loadu_ps(cw + (size_t)g * 16), c1 = _mm512_loadu_ps(cw + ((size_t)G + g) * 16);
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

#elif defined(__AVX2__)

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

/* One group's float epilogue for R rows x 16 columns: f += dot * sw * sa + cw * mn, with the minimum folded to
 * mn + 128 * sa for WIDE's centred quants (shared by block16 and block16_short). */
static inline __attribute__((always_inline)) void group_epilogue(const int R, const int WIDE, __m256i ia[][2],
                                                                 __m256 f[][2], const float *sw, const float *cw,
                                                                 const float *sa, const float *mn, int G, int g) {
    const __m256 s0 = _mm256_loadu_ps(sw + (size_t)g * 16), s1 = _mm256_loadu_ps(sw + (size_t)g * 16 + 8);
    const __m256 c0 = _mm256_loadu_ps(cw + (size_t)g * 16), c1 = _mm256_loadu_ps(cw + (size_t)g * 16 + 8);
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
static inline __attribute__((always_inline)) void block16(const int R, const int WIDE, const qact_t *q, int ldq,
                                                          int Kp, const float *sa, const float *mn, const int8_t *w,
                                                          const float *sw, const float *cw, float acc[MR][32],
                                                          int col) {
    const int G = Kp / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[MR][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i ia[MR][2];
        for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
        for (int k4 = g * (QK / 4); k4 < (g + 1) * (QK / 4); k4++) {
            __m256i b0, b1;
            load_k4(w, k4, &b0, &b1);
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
        group_epilogue(R, WIDE, ia, f, sw, cw, sa, mn, G, g);
    }
    store16(R, f, acc, 0, col);
}

/* SHORT (max|w| <= 16: the default GGUF's Q5_0 tensors, q5 - 16): vpmaddubsw's pair sums are within 2 * 255 * 16
 * = 8160, so four k4 steps add up in int16 (<= 32640, exact) before one vpmaddwd widens them: a quarter of WIDE 0's
 * vpmaddwd + vpaddd. Each output vector then needs three registers (float, int32, int16 sums), so at most two rows
 * per pass (6 x 2 + two weight vectors + the activation = 15 ymm; the ones are a memory operand). */
static inline __attribute__((always_inline)) void block16_short(const int R, const qact_t *q, int ldq, int Kp,
                                                                const float *sa, const float *mn, const int8_t *w,
                                                                const float *sw, const float *cw, float acc[MR][32],
                                                                int row, int col) {
    static const int16_t ONES[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int G = Kp / QK;
    __m256 f[2][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i ia[2][2];
        for (int half = 0; half < 2; half++) {
            __m256i s[2][2];
            for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            const int k0 = g * (QK / 4) + half * 4;
            for (int k4 = k0; k4 < k0 + 4; k4++) {
                __m256i b0, b1;
                load_k4(w, k4, &b0, &b1);
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
        group_epilogue(R, 0, ia, f, sw, cw, sa, mn, G, g);
    }
    store16(R, f, acc, row, col);
}

/* WIDE: PATH_DIRECT, PATH_SIGN (the sign trick) or PATH_SHORT (int16 sums over four k4 steps, two rows at a time) */
static inline __attribute__((always_inline)) void tile(const int R, const int WIDE, const qact_t *q, int ldq,
                                                       int Kp, const float *sa, const float *mn, const int8_t *w,
                                                       const float *sw, const float *cw, float acc[MR][32]) {
    const int K4 = Kp / 4, G = Kp / QK;
    if (WIDE == PATH_SHORT) {
        for (int c = 0; c < 2; c++) {
            const int8_t *wc = w + (size_t)c * K4 * 64;
            const float *swc = sw + (size_t)c * G * 16, *cwc = cw + (size_t)c * G * 16;
            for (int r0 = 0; r0 < R; r0 += 2) {
                const qact_t *qr = q + (size_t)r0 * ldq;
                const float *sar = sa + (size_t)r0 * G, *mnr = mn + (size_t)r0 * G;
                if (R - r0 >= 2) block16_short(2, qr, ldq, Kp, sar, mnr, wc, swc, cwc, acc, r0, 16 * c);
                else block16_short(1, qr, ldq, Kp, sar, mnr, wc, swc, cwc, acc, r0, 16 * c);
            }
        }
        return;
    }
    block16(R, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc, 0);
    block16(R, WIDE, q, ldq, Kp, sa, mn, w + (size_t)K4 * 64, sw + (size_t)G * 16, cw + (size_t)G * 16, acc, 16);
}

/* WIDE's activation rows: [|q - 128| (Kp bytes) | q - 128 as int8 (Kp bytes)] per row; malloc'd, caller frees. */
#define HAVE_WIDE 1
static qact_t *centre_rows(const qact_t *q, int M, int Kp, int nt) {
    qact_t *out = (qact_t *)malloc((size_t)M * 2 * Kp);
#pragma omp parallel for schedule(static) num_threads(nt) if (M > 8)
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

#else

static void tile(const int R, const int WIDE, const qact_t *q, int ldq, int Kp, const float *sa, const float *mn,
                 const int8_t *w, const float *sw, const float *cw, float acc[MR][32]) {
    (void)WIDE;
    const int K4 = Kp / 4, G = Kp / QK;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 32; j++) {
            const int blk = j / 16, lane = j % 16;
            const int8_t *wb = w + (size_t)blk * K4 * 64 + lane * 4;
            const float *s = sw + (size_t)blk * G * 16 + lane, *c = cw + (size_t)blk * G * 16 + lane;
            float y = 0.0f;
            for (int g = 0; g < G; g++) {
                int32_t dot = 0;
                for (int k = g * QK; k < (g + 1) * QK; k++)
                    dot += (int32_t)q[(size_t)r * ldq + k] * wb[(size_t)(k / 4) * 64 + k % 4];
                y = fmaf((float)dot, s[(size_t)g * 16] * sa[(size_t)r * G + g], y);
                y = fmaf(c[(size_t)g * 16], mn[(size_t)r * G + g], y);
            }
            acc[r][j] = y;
        }
}

#endif

/* R (1..MR) rows of a tile: a constant R (and WIDE) per case, so the compiler unrolls each case's row loops. */
#define TILE_CASES(WIDE)                                                                          \
    switch (R) {                                                                                  \
    ROWS_6_5(WIDE) ROWS_4(WIDE) ROWS_3(WIDE)                                                      \
    case 2: tile(2, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;                             \
    default: tile(1, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;                            \
    }
#if MR >= 6
#define ROWS_6_5(WIDE) case 6: tile(6, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;          \
                       case 5: tile(5, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;
#else
#define ROWS_6_5(WIDE)
#endif
#if MR >= 4
#define ROWS_4(WIDE) case 4: tile(4, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;
#else
#define ROWS_4(WIDE)
#endif
#if MR >= 3
#define ROWS_3(WIDE) case 3: tile(3, WIDE, q, ldq, Kp, sa, mn, w, sw, cw, acc); break;
#else
#define ROWS_3(WIDE)
#endif

static inline __attribute__((always_inline)) void tile_rows(const int R, const int wide, const qact_t *q, int ldq,
                                                            int Kp, const float *sa, const float *mn,
                                                            const int8_t *w, const float *sw, const float *cw,
                                                            float acc[MR][32]) {
#ifdef HAVE_WIDE
    if (wide == PATH_SIGN) {
        TILE_CASES(PATH_SIGN)
        return;
    }
    if (wide == PATH_SHORT) {
        TILE_CASES(PATH_SHORT)
        return;
    }
#else
    (void)wide;
#endif
    TILE_CASES(PATH_DIRECT)
}

/* The activations as the tiles read them: q itself (row stride Kp), or for the avx2 build's WIDE path (weights
 * beyond +-64) its centred rows (stride 2 Kp, malloc'd: *owned is set and the caller frees it). */
static const qact_t *tile_input(const qact_t *q, int M, int Kp, int wmax, int nt, int *wide, int *ldq,
                                qact_t **owned) {
    *owned = NULL;
    *wide = PATH_DIRECT;
    *ldq = Kp;
#ifdef HAVE_WIDE
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
#else
    (void)M;
    (void)wmax;
    (void)nt;
#endif
    return q;
}

/* y[M, N] (row stride ldy, float32 or bf16) = dequant(q) @ W^T. Work items: (row chunk, 32-column pair of
 * weight blocks), split over the OpenMP threads; each weight pair (Kp x 32 bytes) is reused by every MR-row
 * tile of its chunk while it sits in L1/L2. */
static void gemm(const qact_t *q0, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                 const float *sw, const float *cw, int Np, int N, int wmax, void *y, int ldy, int is_bf16, int glu,
                 int nt) {
    if (M <= 0) return;
    const int G = Kp / QK, K4 = Kp / 4, npair = Np / 32;
    /* chunks of at most MC rows, of equal size (in whole tiles): with 48 rows and MC 30 a 30 + 18 split left one
     * of two threads idle for part of each decode-step linear (docs/perf/code-notes-kernels.md) */
    const int chunks = (M + MC - 1) / MC, even = (M + chunks - 1) / chunks;
    const int mcr = (even + MR - 1) / MR * MR, nmc = (M + mcr - 1) / mcr;
    int wide, ldq;
    qact_t *owned;
    const qact_t *q = tile_input(q0, M, Kp, wmax, nt, &wide, &ldq, &owned);
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int mc = 0; mc < nmc; mc++)
        for (int np = 0; np < npair; np++) {
            const int8_t *wp = w + (size_t)np * 2 * K4 * 64;
            const float *swp = sw + (size_t)np * 2 * G * 16, *cwp = cw + (size_t)np * 2 * G * 16;
            const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
            const int m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            float acc[MR][32];
            for (int m = mc * mcr; m < m_end; m += MR) {
                const int R = m_end - m < MR ? m_end - m : MR;
                const float *sam = sa + (size_t)m * G, *mnm = mn + (size_t)m * G;
                tile_rows(R, wide, q + (size_t)m * ldq, ldq, Kp, sam, mnm, wp, swp, cwp, acc);
                if (glu)   /* N = 2I, I a multiple of 16 (the caller checks): every pair is whole */
                    for (int r = 0; r < R; r++) store_glu(acc[r], y, is_bf16, (size_t)(m + r) * ldy + np * 16, glu);
                else
                    for (int r = 0; r < R; r++) store_row(acc[r], y, is_bf16, (size_t)(m + r) * ldy + np * 32, ncols);
            }
        }
    free(owned);
}

/* wmax: max|w| of the packed weights (a bound: larger is always correct; the avx2 build takes its faster path
 * only for wmax <= 64) */
void q8_gemm_f32(const qact_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                 const float *sw, const float *cw, int Np, int N, int wmax, float *y, int ldy, int nt) {
    gemm(q, sa, mn, M, Kp, w, sw, cw, Np, N, wmax, y, ldy, 0, GLU_NONE, nt);
}
void q8_gemm_bf16(const qact_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                  const float *sw, const float *cw, int Np, int N, int wmax, uint16_t *y, int ldy, int nt) {
    gemm(q, sa, mn, M, Kp, w, sw, cw, Np, N, wmax, y, ldy, 1, GLU_NONE, nt);
}

/* x [M, K] (row stride ldx, float32 or bf16) @ W^T in one call: the activations quantized into scratch of this
 * call's own, then gemm. The same quants and products as q8_quant_act_* + q8_gemm_*, without the two extra
 * calls and three scratch tensors per linear on the Python side (72 linears per decode step of gemma-3-270m). */
static void linear(const void *x, int is_bf16, int M, int K, int ldx, const int8_t *w, const float *sw,
                   const float *cw, int Np, int N, int wmax, void *y, int ldy, int glu, int nt) {
    if (M <= 0) return;
    const int Kp = (K + QK - 1) / QK * QK, G = Kp / QK;
    qact_t *q = (qact_t *)malloc((size_t)M * Kp + sizeof(float) * 2 * (size_t)M * G);
    float *sa = (float *)(q + (size_t)M * Kp), *mn = sa + (size_t)M * G;   /* Kp is a multiple of 32: aligned */
    quant_act(x, is_bf16, M, K, ldx, Kp, q, sa, mn, nt);
    gemm(q, sa, mn, M, Kp, w, sw, cw, Np, N, wmax, y, ldy, is_bf16, glu, nt);
    free(q);
}

void q8_linear_f32(const float *x, int M, int K, int ldx, const int8_t *w, const float *sw, const float *cw, int Np,
                   int N, int wmax, float *y, int ldy, int nt) {
    linear(x, 0, M, K, ldx, w, sw, cw, Np, N, wmax, y, ldy, GLU_NONE, nt);
}
void q8_linear_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const float *sw, const float *cw,
                    int Np, int N, int wmax, uint16_t *y, int ldy, int nt) {
    linear(x, 1, M, K, ldx, w, sw, cw, Np, N, wmax, y, ldy, GLU_NONE, nt);
}

/* x @ W^T for a gate_up weight interleaved in 16-row blocks (see store_glu), then the GLU: y [M, N / 2] (row
 * stride ldy). act: GLU_GELU_TANH or GLU_SILU; N a multiple of 32. */
void q8_linear_glu_f32(const float *x, int M, int K, int ldx, const int8_t *w, const float *sw, const float *cw,
                       int Np, int N, int wmax, int act, float *y, int ldy, int nt) {
    linear(x, 0, M, K, ldx, w, sw, cw, Np, N, wmax, y, ldy, act == GLU_SILU ? GLU_SILU : GLU_GELU_TANH, nt);
}
void q8_linear_glu_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const float *sw, const float *cw,
                        int Np, int N, int wmax, int act, uint16_t *y, int ldy, int nt) {
    linear(x, 1, M, K, ldx, w, sw, cw, Np, N, wmax, y, ldy, act == GLU_SILU ? GLU_SILU : GLU_GELU_TANH, nt);
}

/* Greedy decoding's LM head: per row, the largest y[m, n] = dequant(q) @ W^T and its index (the first on ties,
 * like argmax), without writing y (a [rows, 262144] float32 block per decode step). Each thread scans a
 * contiguous range of 32-column pairs in order with the same tiles as gemm (so the values compared are gemm's,
 * bit for bit); the ranges are merged in order. A NaN never wins. */
void q8_gemm_argmax(const qact_t *q0, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                    const float *sw, const float *cw, int Np, int N, int wmax, int64_t *idx, float *val, int nt) {
    const int G = Kp / QK, K4 = Kp / 4, npair = Np / 32;
    nt = nt < 1 ? 1 : nt;
    int wide, ldq;
    qact_t *owned;
    const qact_t *q = tile_input(q0, M, Kp, wmax, nt, &wide, &ldq, &owned);
    /* per thread and row, the best value and its column for each of the 32 tile columns (j = column % 32): the
     * comparisons are branch-free and vectorize; the 32 lanes are reduced once at the end */
    float *bv = (float *)malloc(sizeof(float) * (size_t)nt * M * 32);
    int32_t *bi = (int32_t *)malloc(sizeof(int32_t) * (size_t)nt * M * 32);
    int used = 1;
#pragma omp parallel num_threads(nt)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
#pragma omp single
        used = nth;
        float *v = bv + (size_t)tid * M * 32;
        int32_t *ix = bi + (size_t)tid * M * 32;
        for (int i = 0; i < M * 32; i++) { v[i] = -INFINITY; ix[i] = 0; }
        const int p0 = (int)((int64_t)npair * tid / nth), p1 = (int)((int64_t)npair * (tid + 1) / nth);
        float acc[MR][32];
        for (int np = p0; np < p1; np++) {
            const int8_t *wp = w + (size_t)np * 2 * K4 * 64;
            const float *swp = sw + (size_t)np * 2 * G * 16, *cwp = cw + (size_t)np * 2 * G * 16;
            const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
            for (int m = 0; m < M; m += MR) {
                const int R = M - m < MR ? M - m : MR;
                const float *sam = sa + (size_t)m * G, *mnm = mn + (size_t)m * G;
                tile_rows(R, wide, q + (size_t)m * ldq, ldq, Kp, sam, mnm, wp, swp, cwp, acc);
                for (int r = 0; r < R; r++) {
                    float *vr = v + (size_t)(m + r) * 32;
                    int32_t *ir = ix + (size_t)(m + r) * 32;
                    for (int j = 0; j < 32; j++) {      /* strict >: a lane keeps its first maximum; NaN never wins */
                        const int better = j < ncols && acc[r][j] > vr[j];
                        vr[j] = better ? acc[r][j] : vr[j];
                        ir[j] = better ? np * 32 + j : ir[j];
                    }
                }
            }
        }
    }
    /* merge: the largest value over threads and lanes, the lowest column among equal ones (argmax's first) */
    for (int m = 0; m < M; m++) {
        float best = -INFINITY;
        int64_t at = 0;
        for (int t = 0; t < used; t++)
            for (int j = 0; j < 32; j++) {
                const float x = bv[((size_t)t * M + m) * 32 + j];
                const int64_t c = bi[((size_t)t * M + m) * 32 + j];
                if (x > best || (x == best && x > -INFINITY && c < at)) { best = x; at = c; }
            }
        idx[m] = at;
        val[m] = best;
    }
    free(bv);
    free(bi);
    free(owned);
}
