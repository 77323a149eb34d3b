/* Paged decode attention (driver.h) on AVX512-BF16: over bf16 and int8 caches the scores and P.V are bf16 pair dot
 * products (vdpbf16ps; an int8 group dequantized and rounded to bf16 on the way in), over float32 caches vec.h's
 * pieces at 16 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if PAGED_DECODE_ISA == ISA_AVX512_BF16
#include "../simd/avx512.h"

#define FAST_PATH 1
#define PAIRED_PV 1
#define I8_IN_DOT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_SCORES 1
#include "../amx.h"
#include "../bf16_gemm/bf16_gemm.h"
#endif
#include "driver.h"
#include "vec.h"


/* The sixteen horizontal sums of v[0..15] as one vector (lane i = sum of v[i]): a transpose-and-add tree of 45
 * instructions where sixteen _mm512_reduce_add_ps take ~130. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
    __m512 z[4];
    for (int k = 0; k < 4; k++) {
        const __m512 a = v[4 * k], b = v[4 * k + 1], c = v[4 * k + 2], d = v[4 * k + 3];
        const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));   /* a02 b02 a13 b13 */
        const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
        z[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)),      /* per 128-bit lane L: */
                             _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));     /* [a_L b_L c_L d_L] */
    }
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44), _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44), _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* 32 consecutive elements of a bf16 row, or one group of 32 of an int8 row dequantized and rounded to bf16
 * (quant * *sc, its group's scale), for the AVX512-BF16 dot products: two vpmovsxbd, two vcvtdq2ps, two vmulps
 * and one vcvtne2ps2bf16 per 32. */
static inline __attribute__((always_inline)) __m512i load_bh32(const void *base, int64_t i, const int kind,
                                                               const float *sc) {
    if (kind == KV_I8) {
        const int8_t *p = (const int8_t *)base + i;
        const __m512 f = _mm512_set1_ps(*sc);
        const __m512 lo = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), f);
        const __m512 hi = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))), f);
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);   /* elements 0-15 from lo, 16-31 from hi */
    }
    (void)sc;
    return _mm512_loadu_si512((const void *)((const uint16_t *)base + i));
}

static inline __attribute__((always_inline)) void fast_scores(
        const int G, const int kind, const float *qf, const uint16_t *qb, const void *k, int64_t stride,
        int32_t n, int32_t D, float *s, int32_t ld, const float *sc, int64_t sc_stride) {
    int32_t j = 0;
    if (kind == KV_BF16 || kind == KV_I8) {             /* 32 bf16 pairs per instruction */
        const int TJ = 16 / G;          /* tokens per pass: G * TJ = 16 accumulators, summed by one hsum16 */
        for (; j + TJ <= n; j += TJ) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int32_t c = 0; c < D; c += 32) {
                __m512bh qv[8];
                for (int g = 0; g < G; g++) qv[g] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + c));
                for (int t = 0; t < TJ; t++) {
                    const __m512bh kx = (__m512bh)load_bh32(k, (j + t) * stride + c, kind,
                                                            sc + (j + t) * sc_stride + c / I8_GROUP);
                    for (int g = 0; g < G; g++) acc[g * TJ + t] = _mm512_dpbf16_ps(acc[g * TJ + t], qv[g], kx);
                }
            }
            /* lane g * TJ + t is s[g * ld + j + t]: one masked store per query row (ld >= TJ: never before s) */
            const __m512 sums = hsum16(acc);
            for (int g = 0; g < G; g++)
                _mm512_mask_storeu_ps(s + g * (ld - TJ) + j, (__mmask16)(((1u << TJ) - 1) << (g * TJ)), sums);
        }
        for (; j + 1 < n; j += 2) {                     /* two tokens at a time: 2G independent chains */
            __m512 a[8], b[8];
            for (int g = 0; g < G; g++) a[g] = b[g] = _mm512_setzero_ps();
            for (int32_t c = 0; c < D; c += 32) {
                __m512bh x0 = (__m512bh)load_bh32(k, j * stride + c, kind, sc + j * sc_stride + c / I8_GROUP);
                __m512bh x1 = (__m512bh)load_bh32(k, (j + 1) * stride + c, kind,
                                                  sc + (j + 1) * sc_stride + c / I8_GROUP);
                for (int g = 0; g < G; g++) {
                    __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + c));
                    a[g] = _mm512_dpbf16_ps(a[g], qv, x0);
                    b[g] = _mm512_dpbf16_ps(b[g], qv, x1);
                }
            }
            for (int g = 0; g < G; g++) {
                s[g * ld + j] = _mm512_reduce_add_ps(a[g]);
                s[g * ld + j + 1] = _mm512_reduce_add_ps(b[g]);
            }
        }
        for (; kind == KV_I8 && j < n; j++) {           /* an int8 row has no float32 form: its odd last token here */
            __m512 a[8];
            for (int g = 0; g < G; g++) a[g] = _mm512_setzero_ps();
            for (int32_t c = 0; c < D; c += 32) {
                const __m512bh x = (__m512bh)load_bh32(k, j * stride + c, kind, sc + j * sc_stride + c / I8_GROUP);
                for (int g = 0; g < G; g++)
                    a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + c)), x);
            }
            for (int g = 0; g < G; g++) s[g * ld + j] = _mm512_reduce_add_ps(a[g]);
        }
    }
    vec_scores(G, kind, qf, k, stride, j, n, D, s, ld);
}

/* acc[g] += sum over token pairs k of word(g, k) . (v_2k, v_2k+1), word(g, k) = pw[g * gs + k * ks] the pair
 * (p_2k, p_2k+1) of row g in bf16: paired_accumulate's loop, and the AMX path's (its probabilities per pair and row) */
static inline __attribute__((always_inline)) void pv_words(
        const int G, const int kind, float *acc, const uint32_t *pw, int64_t gs, int64_t ks, const void *v,
        int64_t stride, int32_t n, int32_t D, const float *sc, int64_t sc_stride) {
    const int32_t np = (n + 1) / 2;
    for (int32_t c = 0; c < D; c += 32) {
        __m512 lo[8], hi[8];
        for (int g = 0; g < G; g++) {
            lo[g] = _mm512_loadu_ps(acc + g * D + c);
            hi[g] = _mm512_loadu_ps(acc + g * D + c + 16);
        }
        for (int32_t k = 0; k < np; k++) {
            const int32_t j1 = 2 * k + 1 < n ? 2 * k + 1 : 2 * k;        /* odd tail: partner weight is 0 */
            const __m512i x0 = load_bh32(v, 2 * k * stride + c, kind, sc + 2 * k * sc_stride + c / I8_GROUP);
            const __m512i x1 = load_bh32(v, j1 * stride + c, kind, sc + j1 * sc_stride + c / I8_GROUP);
            const __m512bh plo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            const __m512bh phi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            for (int g = 0; g < G; g++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[g * gs + k * ks]);
                lo[g] = _mm512_dpbf16_ps(lo[g], w, plo);
                hi[g] = _mm512_dpbf16_ps(hi[g], w, phi);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm512_storeu_ps(acc + g * D + c, lo[g]);
            _mm512_storeu_ps(acc + g * D + c + 16, hi[g]);
        }
    }
}

/* acc[g] += sum_j p[g*ld + j] * v_j with AVX512-BF16 (bf16 and int8 caches): tokens in pairs, each instruction a
 * dot product of a (p_j, p_j+1) pair with the interleaved (v_j[d], v_j+1[d]) pairs of 16 columns. The interleave
 * works within 128-bit lanes, so acc holds each 32-column chunk permuted: column r of a chunk (lane = r / 8,
 * i = r % 8) at 4 lane + i for i < 4, else at 16 + 4 lane + i - 4; finish_paired un-permutes once at the end. The
 * probabilities enter as bf16, as in the torch path. */
static inline __attribute__((always_inline)) void paired_accumulate(
        const int G, const int kind, float *acc, const float *p, int32_t ld, const void *v, int64_t stride,
        int32_t n, int32_t D, const float *sc, int64_t sc_stride) {
    uint32_t pairs[8][MAX_BLOCK / 2 + 1];
    const int32_t np = (n + 1) / 2;
    for (int g = 0; g < G; g++) {
        /* sixteen probabilities at a time (vcvtneps2bf16 rounds to nearest even as f32_to_bf16 does; the
         * probabilities are finite and never subnormal, exp_clamped's floor being e^-87), then the odd tail with
         * a zero partner. Scalar conversions were ~15 % of a hot block's time (Zen 4). */
        int32_t k = 0;
        for (; 2 * k + 16 <= n; k += 8)
            _mm256_storeu_si256((__m256i *)&pairs[g][k],
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + g * ld + 2 * k)));
        for (; k < np; k++) {
            const float p0 = p[g * ld + 2 * k], p1 = 2 * k + 1 < n ? p[g * ld + 2 * k + 1] : 0.0f;
            pairs[g][k] = (uint32_t)f32_to_bf16(p0) | ((uint32_t)f32_to_bf16(p1) << 16);
        }
    }
    pv_words(G, kind, acc, &pairs[0][0], MAX_BLOCK / 2 + 1, 1, v, stride, n, D, sc, sc_stride);
}

/* bf16 and int8 caches: paired_accumulate; float32 caches: vec.h's loops */
static inline __attribute__((always_inline)) void fast_accumulate(
        const int G, const int kind, float *acc, const float *p, int32_t ld, const void *v, int64_t stride,
        int32_t n, int32_t D, const float *sc, int64_t sc_stride) {
    if (kind == KV_BF16 || kind == KV_I8) {
        paired_accumulate(G, kind, acc, p, ld, v, stride, n, D, sc, sc_stride);
        return;
    }
    vec_accumulate(G, kind, acc, p, ld, v, stride, n, D);
}

/* paired_accumulate's column order undone two vectors at a time (vpermt2ps), not element by element */
static inline __attribute__((always_inline)) void finish_paired(const rows_t *r, void *out, int64_t q0, int32_t G,
                                                                int32_t D, const int is_bf16) {
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int32_t g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(r->l[g] > 0.0f ? 1.0f / r->l[g] : 0.0f);
        for (int32_t c = 0; c < D; c += 32) {
            const __m512 lo = _mm512_loadu_ps(r->acc + g * D + c), hi = _mm512_loadu_ps(r->acc + g * D + c + 16);
            const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, i0, hi), inv);
            const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, i1, hi), inv);
            const int64_t o = q0 + g * D + c;
            if (is_bf16) {
                _mm512_storeu_si512((void *)((uint16_t *)out + o), (__m512i)_mm512_cvtne2ps_pbh(b, a));
            } else {
                _mm512_storeu_ps((float *)out + o, a);
                _mm512_storeu_ps((float *)out + o + 16, b);
            }
        }
    }
}

#if AMX_SCORES
/* A bf16 cache's decode attention with AMX scores (driver.h AMX_SCORES): scores^T [16 tokens][16 query rows] = K
 * (a block's 16 rows of 32 dims, as they lie in the cache) . Q^T (the query's pairs, built once per sequence), one
 * TDPBF16PS per 32 dims into a C tile per block, AMX_RUN blocks' products issued together (one block at a time
 * waited on each product's latency and was slower than the vector form). The vector form sums G rows x 2 tokens
 * per pass and reduces 16 accumulators with a 45-instruction tree each time. The online softmax then runs on the
 * transposed scores, a lane per query row (no horizontal reductions, no transpose), and P.V is the vector path's
 * paired dot products with the probabilities' pairs read per row, or from AMX_PV_MIN_G rows a tile product
 * (amx_pv). On shared blocks the query tile holds several members' rows (amx_stack_tiles; each lane's scores,
 * maximum, exponentials, sums and P.V row are its own: the same bits as alone). Tiles: 0 the query's k-step, 2-3
 * K rows (alternating), 4-7 one block's scores each (amx_pv then reuses 1-5). A sequence's blocks take the same
 * instructions in every work item. */
static int amx_scores_ok(int32_t G, int32_t D, int32_t bs) {
    return G <= 16 && D % 32 == 0 && D <= 256 && bs == 16 && bf16_gemm_tiles_on();
}

static void amx_scores_begin(void) { amx_config_tiles(8); }
static void amx_scores_end(void) { _tile_release(); }

static void amx_query_tiles(const uint16_t *qb, int32_t G, int32_t D, uint32_t *qt) {
    memset(qt, 0, sizeof(uint32_t) * (size_t)(D / 2) * 16);
    for (int32_t g = 0; g < G; g++)
        for (int32_t i = 0; i < D / 2; i++) qt[(i / 16) * 256 + (i % 16) * 16 + g] = pair_at(qb + (int64_t)g * D, i);
}

/* block i's K rows at its k-step kk into tile T, then its scores' C tile += them . the query's k-step (tile 0) */
#define RUN_PRODUCT(i, T, C)                                                          \
    if (nb > (i)) {                                                                   \
        _tile_loadd(T, rows_at[i] + kk * 32, lda[i] * 2);                             \
        _tile_dpbf16ps(C, T, 0);                                                      \
    }

static void amx_run_scores(const rows_t *r, int32_t b0, int32_t nb, const uint16_t *kc, int32_t bs,
                           int64_t tok_stride, int32_t h, int32_t D, float *s, uint16_t *scratch) {
    const uint16_t *rows_at[AMX_RUN];
    int64_t lda[AMX_RUN];
    int32_t n[AMX_RUN];
    for (int32_t i = 0; i < nb; i++) {
        int32_t slot;
        const int64_t base = block_rows(r->table, b0 + i, r->lo, r->seq_len, bs, tok_stride, bs * tok_stride, h, D,
                                        &n[i], &slot);
        rows_at[i] = kc + base;
        lda[i] = tok_stride;
        if (n[i] < 16) {          /* a partial block: the rows past its tokens may be another block's, or none */
            uint16_t *dst = scratch + (size_t)i * 16 * D;
            memset(dst, 0, sizeof(uint16_t) * 16 * (size_t)D);
            for (int32_t t = 0; t < n[i]; t++) memcpy(dst + (size_t)t * D, rows_at[i] + t * tok_stride, (size_t)D * 2);
            rows_at[i] = dst;
            lda[i] = D;
        }
    }
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int32_t kk = 0; kk < D / 32; kk++) {
        _tile_loadd(0, r->qt + kk * 256, 64);
        RUN_PRODUCT(0, 2, 4)
        RUN_PRODUCT(1, 3, 5)
        RUN_PRODUCT(2, 2, 6)
        RUN_PRODUCT(3, 3, 7)
    }
    /* the next run's keys into L2 while these products finish (its values come with each block's visit) */
    const int32_t last = (r->seq_len + bs - 1) / bs;
    for (int32_t b = b0 + nb; b < b0 + 2 * nb && b < last; b++)
        prefetch_rows((const char *)(kc + (int64_t)r->table[b] * bs * tok_stride + (int64_t)h * D), tok_stride * 2, bs,
                      D * 2);
    _tile_stored(4, s, 64);
    if (nb > 1) _tile_stored(5, s + 256, 64);
    if (nb > 2) _tile_stored(6, s + 512, 64);
    if (nb > 3) _tile_stored(7, s + 768, 64);
}

static void amx_stack_tiles(const rows_t *rs, int32_t members, int32_t G, int32_t D, uint32_t *qt) {
    for (int32_t i = 0; i < D / 2; i++) {
        const int64_t at = (int64_t)(i / 16) * 256 + (i % 16) * 16;
        for (int32_t x = 0; x < 16; x++) qt[at + x] = x < members * G ? rs[x / G].qt[at + x % G] : 0;
    }
}

/* A tile rows from eight pair words per lane (w[k] lane x: lane x's probabilities of tokens 2k, 2k+1): a[x][k] =
 * w[k][x] for k < 8, a[x][8..15] = 0 (the tile's other eight pairs) - a transpose in three rounds of permutes */
static inline void transpose_pairs(const __m512i w[8], uint32_t a[16][16]) {
    const __m512i i_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i i_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i q_lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i q_hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i r01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i r23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    __m512i s[8];           /* s[2p + h]: qwords (w[2p][x], w[2p+1][x]) for x = 8h .. 8h + 7 */
    for (int p = 0; p < 4; p++) {
        s[2 * p] = _mm512_permutex2var_epi32(w[2 * p], i_lo, w[2 * p + 1]);
        s[2 * p + 1] = _mm512_permutex2var_epi32(w[2 * p], i_hi, w[2 * p + 1]);
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 2; r++) {     /* 128-bit lane L: words 0-3 (u0) and 4-7 (u1) of x = 8h + 4r + L */
            const __m512i q = r ? q_hi : q_lo;
            const __m512i u0 = _mm512_permutex2var_epi64(s[h], q, s[2 + h]);
            const __m512i u1 = _mm512_permutex2var_epi64(s[4 + h], q, s[6 + h]);
            const int x = 8 * h + 4 * r;
            const __m512i o01 = _mm512_permutex2var_epi64(u0, r01, u1), o23 = _mm512_permutex2var_epi64(u0, r23, u1);
            _mm512_store_si512(a[x], _mm512_zextsi256_si512(_mm512_castsi512_si256(o01)));
            _mm512_store_si512(a[x + 1], _mm512_zextsi256_si512(_mm512_extracti64x4_epi64(o01, 1)));
            _mm512_store_si512(a[x + 2], _mm512_zextsi256_si512(_mm512_castsi512_si256(o23)));
            _mm512_store_si512(a[x + 3], _mm512_zextsi256_si512(_mm512_extracti64x4_epi64(o23, 1)));
        }
}

/* Query rows per KV head from which P.V runs on the tiles (amx_pv), below it the vector dot products (pv_words):
 * a function of the shape only, so a sequence's arithmetic never depends on its group. With few rows the vector
 * form is short and the tiles' fixed work (the probabilities transposed, the values' pairs and the sums through
 * memory) costs more; docs/perf/xeon-amx.md has the crossover. */
#define AMX_PV_MIN_G 6

/* P.V of one block on the tiles for the stack's lanes: C[x][j] = sum over pairs k of (p_2k, p_2k+1)[x] .
 * (v_2k, v_2k+1)[d_j], the values' pairs interleaved as pv_words interleaves them (so C's columns are acc's paired
 * order), then added to each member's acc rows. Tiles: 1 the probabilities, 2-3 the values, 4-5 the sums. */
static inline void amx_pv(rows_t *rs, int32_t members, int32_t G, const __m512i w[8], int32_t n, const uint16_t *v,
                          int64_t stride, int32_t D) {
    uint32_t a[16][16] __attribute__((aligned(64)));
    /* the values' pairs: rows 8-15 (pairs 8-15, as a's) zero from the thread's start, never written */
    static __thread uint32_t b[2][16][16] __attribute__((aligned(64)));
    float c[2][16][16] __attribute__((aligned(64)));
    transpose_pairs(w, a);
    _tile_loadd(1, a, 64);
    const __m512i z = _mm512_setzero_si512();
    const int32_t np = (n + 1) / 2;
    for (int32_t c0 = 0; c0 < D; c0 += 32) {
        for (int32_t k = 0; k < 8; k++) {
            __m512i lo = z, hi = z;
            if (k < np) {
                const __m512i x0 = _mm512_loadu_si512((const void *)(v + 2 * k * stride + c0));
                const __m512i x1 =
                    2 * k + 1 < n ? _mm512_loadu_si512((const void *)(v + (2 * k + 1) * stride + c0)) : z;
                lo = _mm512_unpacklo_epi16(x0, x1);
                hi = _mm512_unpackhi_epi16(x0, x1);
            }
            _mm512_storeu_si512(b[0][k], lo);     /* (a thread-local's alignment is the loader's to keep) */
            _mm512_storeu_si512(b[1][k], hi);
        }
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(2, b[0], 64);
        _tile_dpbf16ps(4, 1, 2);
        _tile_loadd(3, b[1], 64);
        _tile_dpbf16ps(5, 1, 3);
        _tile_stored(4, c[0], 64);
        _tile_stored(5, c[1], 64);
        for (int32_t x = 0; x < members * G; x++) {
            float *acc = rs[x / G].acc + (x % G) * D + c0;
            _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_load_ps(c[0][x])));
            _mm512_storeu_ps(acc + 16, _mm512_add_ps(_mm512_loadu_ps(acc + 16), _mm512_load_ps(c[1][x])));
        }
    }
}

/* each member's G-lane slice of a running state vector (m or l; `fill` elsewhere): member i's at lanes i*G .. */
static inline __m512 lanes_load(const rows_t *rs, int32_t members, int32_t G, int which, __m512 fill) {
    const __mmask16 rows = (__mmask16)((1u << G) - 1);
    for (int32_t i = 0; i < members; i++)
        fill = _mm512_mask_loadu_ps(fill, (__mmask16)(rows << (i * G)), (which ? rs[i].l : rs[i].m) - i * G);
    return fill;
}

static inline void lanes_store(rows_t *rs, int32_t members, int32_t G, int which, __m512 v) {
    const __mmask16 rows = (__mmask16)((1u << G) - 1);
    for (int32_t i = 0; i < members; i++)
        _mm512_mask_storeu_ps((which ? rs[i].l : rs[i].m) - i * G, (__mmask16)(rows << (i * G)), v);
}

static inline __attribute__((always_inline)) void softmax_accumulate_lanes(
        rows_t *rs, int32_t members, const float *st, int32_t n, int32_t G, int32_t D, const uint16_t *v,
        int64_t stride) {
    const __mmask16 lanes = (__mmask16)((1u << (members * G)) - 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 bm = ninf;
    for (int32_t t = 0; t < n; t++) bm = _mm512_max_ps(bm, _mm512_load_ps(st + t * 16));
    const __m512 m = lanes_load(rs, members, G, 0, ninf), nm = _mm512_max_ps(m, bm);
    /* exp(m - nm); exactly 1 where the maximum stayed (no rescale), 0 before any key */
    __m512 corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, nm, _CMP_EQ_OQ), exp16_fast(_mm512_sub_ps(m, nm)),
                                       _mm512_set1_ps(1.0f));
    corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), corr, _mm512_setzero_ps());
    const __mmask16 moved = _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & lanes;
    if (moved) {
        float cf[16] __attribute__((aligned(64)));
        _mm512_store_ps(cf, corr);
        for (int32_t x = 0; x < members * G; x++)
            if (moved >> x & 1) {
                float *a = rs[x / G].acc + (x % G) * D;
                for (int32_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(cf[x])));
            }
    }
    __m512i pt[8];                  /* a block of 16 tokens (amx_scores_ok): pair k's words, zero past the tokens */
    for (int k = 0; k < 8; k++) pt[k] = _mm512_setzero_si512();
    __m512 sum = _mm512_setzero_ps();
    const __m512 nml = _mm512_mul_ps(nm, _mm512_set1_ps(LOG2E_F));
    /* word 2g <- word g (p0's lane g), word 2g + 1 <- word 16 + g (p1's lane g) */
    const __m512i pair_words = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int32_t t = 0; t < n; t += 2) {
        const __m512 p0 = exp_less16(_mm512_load_ps(st + t * 16), nml);
        const __m512 p1 = t + 1 < n ? exp_less16(_mm512_load_ps(st + (t + 1) * 16), nml) : _mm512_setzero_ps();
        sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
        /* both rounded in one instruction (p0's in words 0-15, p1's in 16-31), then each lane's pair interleaved */
        pt[t / 2] = _mm512_permutexvar_epi16(pair_words, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    const __m512 l = lanes_load(rs, members, G, 1, _mm512_setzero_ps());
    lanes_store(rs, members, G, 1, _mm512_add_ps(_mm512_mul_ps(l, corr), sum));
    lanes_store(rs, members, G, 0, nm);
    if (G >= AMX_PV_MIN_G) {
        amx_pv(rs, members, G, pt, n, v, stride, D);
        return;
    }
    uint32_t pw[8][16] __attribute__((aligned(64)));
    for (int k = 0; k < 8; k++) _mm512_store_si512(pw[k], pt[k]);
    for (int32_t i = 0; i < members; i++)
        DISPATCH_G(G, pv_words(G_, KV_BF16, rs[i].acc, &pw[0][i * G], 1, 16, v, stride, n, D, NULL, 0));
}

static void amx_softmax_accumulate(rows_t *rs, int32_t members, const float *st, int32_t n, int32_t G, int32_t D,
                                   const uint16_t *v, int64_t stride) {
    switch (members) {      /* each member count a constant in its own copy */
        case 1: softmax_accumulate_lanes(rs, 1, st, n, G, D, v, stride); break;
        case 2: softmax_accumulate_lanes(rs, 2, st, n, G, D, v, stride); break;
        case 3: softmax_accumulate_lanes(rs, 3, st, n, G, D, v, stride); break;
        default: softmax_accumulate_lanes(rs, 4, st, n, G, D, v, stride); break;
    }
}
#undef RUN_PRODUCT
#endif

#endif
