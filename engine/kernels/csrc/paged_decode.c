/* Attention kernels for the CPU.
 *
 * paged_decode_{bf16,f32}: decode attention, one query token per sequence, keys/values read in place from
 * the paged KV cache (no gather copy), online softmax in float32 (the prefill tile's softmax is masked_softmax.c).
 *
 * Why: the torch path gathers every decode sequence's visible blocks into a contiguous copy, then runs two
 * batched matmuls with M = heads-per-KV-head (4 for gemma-3): the KV bytes move three times at a poor rate.
 * Decode attention is memory-bound, so reading each visible key and value once is what matters.
 *
 * Layouts (all contiguous, row-major):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_stride] int32 (physical block of each logical block)
 *   seq_lens      [num_seqs] int32: keys at positions [lo, seq_len) are visible, lo = max(0, seq_len - window)
 *                 when window > 0, else 0.
 * The query heads h*G .. h*G+G-1 share KV head h (G = num_heads / num_kv_heads).
 *
 * Work item = (group of sequences, KV head); items run in parallel (OpenMP). Sequences are sorted by their
 * block tables and cut into groups that start on the same block (a shared prompt prefix), a few per thread.
 * Each sequence walks its visible blocks in order: scores for the block's tokens, an online-softmax update,
 * then the weighted sum of the block's values; blocks shared by a whole group are walked once for all of its
 * members, so they come from memory once (group_item). A sequence's result never depends on its group. With a vector
 * build (simd.h: AVX-512 or AVX2 + FMA), head_dim a multiple of 32 and G in {1, 2, 4, 8}, both bf16 and float32
 * caches take the vector path (bf16 scores and P.V with AVX512-BF16 dot products where the CPU has them);
 * everything else takes the portable loops, which are also the reference.
 *
 * Built on first use by engine/kernels/build.py (cc -O3 -march=native -fopenmp); plain C, no torch
 * headers, builds in about a second.
 */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "simd.h"

const char *batchgen_kernel_isa(void) { return KERNEL_ISA; }

/* The cache's element kind. KV_I8 (kv_cache_dtype: int8): a block is its bs x Hkv rows of D int8 (D a multiple of
 * 32), then their float32 scales, one per row and group of 32 (value = quant * scale; engine/quant/int8_kv.py),
 * so rows stay 64-byte aligned. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };

#define MAX_GROUP 64
#define MAX_BLOCK 256
#define MAX_MEMBERS 16   /* sequences per work item (see the entry points) */



/* Software prefetch of n rows of `bytes` each (row stride in bytes), one per cache line, into L2 (prefetcht2): a
 * block's 16 KB of keys and values issued into L1 at once (prefetcht0) evicted the block being read (L2 as the
 * target measured faster: docs/perf/code-notes-kernels.md). */
static inline void prefetch_rows(const char *p, int64_t stride, int32_t n, int32_t bytes) {
    for (int32_t j = 0; j < n; j++)
        for (int32_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + j * stride + o, 0, 1);
}

/* Block b of a sequence whose visible keys are [lo, seq_len): *n visible rows starting at the returned element
 * offset (KV head h) in the cache, the first at slot *slot of its block; blocks are bstride elements apart. */
static inline int64_t block_rows(const int32_t *table, int32_t b, int32_t lo, int32_t seq_len, int32_t bs,
                                 int64_t tok_stride, int64_t bstride, int32_t h, int32_t D, int32_t *n,
                                 int32_t *slot) {
    const int32_t t0 = b * bs > lo ? b * bs : lo;
    const int32_t t1 = (b + 1) * bs < seq_len ? (b + 1) * bs : seq_len;
    *n = t1 - t0;
    *slot = t0 - b * bs;
    return (int64_t)table[b] * bstride + (int64_t)*slot * tok_stride + (int64_t)h * D;
}


/* ---- portable tile pieces (float32 tiles) ------------------------------------------------------------- */

/* n rows of D (row stride in elements) from a bf16, float32 or int8 cache into a dense float32 tile (int8: each
 * group of 32 times its scale, row j's at sc + j * sc_stride). */
static void widen(const void *src, int64_t stride, int32_t n, int32_t D, float *dst, const int kind,
                  const float *sc, int64_t sc_stride) {
    for (int32_t j = 0; j < n; j++) {
        if (kind == KV_I8) {
            const int8_t *r = (const int8_t *)src + j * stride;
            const float *f = sc + j * sc_stride;
            for (int32_t d = 0; d < D; d++) dst[(int64_t)j * D + d] = (float)r[d] * f[d / I8_GROUP];
        } else if (kind == KV_BF16) {
            const uint16_t *r = (const uint16_t *)src + j * stride;
            uint32_t *o = (uint32_t *)(dst + (int64_t)j * D);
            for (int32_t d = 0; d < D; d++) o[d] = (uint32_t)r[d] << 16;
        } else {
            memcpy(dst + (int64_t)j * D, (const float *)src + j * stride, sizeof(float) * D);
        }
    }
}

/* s[g*ld + j] = q[g] . k[j]; q [G, D], k [n, D] dense float32. */
static void tile_scores(const float *q, const float *k, int32_t G, int32_t n, int32_t D, float *s, int32_t ld) {
    for (int32_t g = 0; g < G; g++) {
        for (int32_t j = 0; j < n; j++) {
            const float *qg = q + (int64_t)g * D, *kj = k + (int64_t)j * D;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int32_t d = 0; d < D; d++) dot += qg[d] * kj[d];
            s[g * ld + j] = dot;
        }
    }
}

/* acc[g] += sum_j p[g*ld + j] * v[j]; v [n, D] dense float32. */
static void tile_accumulate(float *acc, const float *p, const float *v, int32_t G, int32_t n, int32_t D,
                            int32_t ld) {
    for (int32_t g = 0; g < G; g++) {
        float *ag = acc + (int64_t)g * D;
        for (int32_t j = 0; j < n; j++) {
            const float pj = p[g * ld + j];
            const float *vj = v + (int64_t)j * D;
#pragma omp simd
            for (int32_t d = 0; d < D; d++) ag[d] += pj * vj[d];
        }
    }
}


/* Online softmax over one block: s[g, :n] becomes exp(s - new max); acc, l, m are rescaled. */
static void softmax_update(float *s, int32_t ld, int32_t n, int32_t G, int32_t D, float *m, float *l, float *acc) {
    for (int32_t g = 0; g < G; g++) {
        float *sg = s + g * ld;
        float bmax = m[g];
#pragma omp simd reduction(max:bmax)     /* max is exact: any order gives the same value (vectorized) */
        for (int32_t j = 0; j < n; j++) bmax = sg[j] > bmax ? sg[j] : bmax;
        /* an unchanged maximum (most blocks after the first few) skips the libm call: expf(0) is exactly 1 */
        const float corr = m[g] == -INFINITY ? 0.0f : (m[g] == bmax ? 1.0f : expf(m[g] - bmax));
        if (corr != 1.0f) {
            for (int32_t d = 0; d < D; d++) acc[(int64_t)g * D + d] *= corr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int32_t j = 0; j < n; j++) {
            sg[j] = exp_clamped(sg[j] - bmax);
            sum += sg[j];
        }
        l[g] = l[g] * corr + sum;
        m[g] = bmax;
    }
}

/* ---- vector pieces (AVX-512 or AVX2 + FMA; see simd.h) ------------------------------------------------ */
#if VEC_WIDTH
#define FAST_PATH 1

/* A row of keys or values as float32 vectors, from a bf16 or a float32 cache (an int8 cache is widened into a
 * float32 tile first, or takes the AVX512-BF16 paths). `kind` is a compile-time constant at every call site
 * (always_inline), so each instantiation has no branch. */
static inline __attribute__((always_inline)) vf load_kv(const void *base, int64_t i, const int kind) {
    return kind == KV_BF16 ? vf_load_bf16((const uint16_t *)base + i) : vf_load((const float *)base + i);
}

#if defined(__AVX512BF16__)
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
#endif

#if defined(__AVX512BF16__)
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
#endif

/* s[g*ld + j] = q[g] . k_j for n tokens of one block (row stride `stride`, in elements). G is a compile-time
 * constant at every call site (always_inline + DISPATCH_G), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void fast_scores(
        const int G, const int kind, const float *qf, const uint16_t *qb, const void *k, int64_t stride,
        int32_t n, int32_t D, float *s, int32_t ld, const float *sc, int64_t sc_stride) {
    (void)qb;
    (void)sc;
    (void)sc_stride;
    int32_t j = 0;
#if defined(__AVX512BF16__)
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
#endif
    for (; j + 1 < n; j += 2) {                         /* two tokens at a time: 2G independent chains */
        const int64_t r0 = j * stride, r1 = r0 + stride;
        vf a[8], b[8];
        for (int g = 0; g < G; g++) a[g] = b[g] = vf_zero();
        for (int32_t c = 0; c < D; c += VEC_WIDTH) {
            const vf x0 = load_kv(k, r0 + c, kind), x1 = load_kv(k, r1 + c, kind);
            for (int g = 0; g < G; g++) {
                const vf qv = vf_load(qf + g * D + c);
                a[g] = vf_fma(qv, x0, a[g]);
                b[g] = vf_fma(qv, x1, b[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            s[g * ld + j] = vf_hsum(a[g]);
            s[g * ld + j + 1] = vf_hsum(b[g]);
        }
    }
    for (; j < n; j++) {
        vf a[8];
        for (int g = 0; g < G; g++) a[g] = vf_zero();
        for (int32_t c = 0; c < D; c += VEC_WIDTH) {
            const vf kv = load_kv(k, j * stride + c, kind);
            for (int g = 0; g < G; g++) a[g] = vf_fma(vf_load(qf + g * D + c), kv, a[g]);
        }
        for (int g = 0; g < G; g++) s[g * ld + j] = vf_hsum(a[g]);
    }
}

#if defined(__AVX512BF16__)
/* acc[g] += sum_j p[g*ld + j] * v_j with AVX512-BF16 (bf16 caches): tokens in pairs, each instruction a dot
 * product of a (p_j, p_j+1) pair with the interleaved (v_j[d], v_j+1[d]) pairs of 16 columns. The interleave
 * works within 128-bit lanes, so acc holds each 32-column chunk permuted (see paired_index); the item
 * un-permutes once at the end. The probabilities enter as bf16, as in the torch path. */
#define PAIRED_PV 1
static inline int paired_index(int32_t d) {           /* column d of a chunk -> its slot in acc */
    const int32_t c = d & ~31, r = d & 31, lane = r >> 3, i = r & 7;
    return c + (i < 4 ? 4 * lane + i : 16 + 4 * lane + (i - 4));
}

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
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[g][k]);
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
#else
#define PAIRED_PV 0
static inline int paired_index(int32_t d) { return d; }
#endif

/* acc[g] += sum_j p[g*ld + j] * v_j: per column chunk of two vectors, the G accumulators stay in registers
 * across the block's tokens (2G independent chains). bf16 caches on AVX512-BF16 CPUs take paired_accumulate. */
static inline __attribute__((always_inline)) void fast_accumulate(
        const int G, const int kind, float *acc, const float *p, int32_t ld, const void *v, int64_t stride,
        int32_t n, int32_t D, const float *sc, int64_t sc_stride) {
    (void)sc;
    (void)sc_stride;
#if PAIRED_PV
    if (kind == KV_BF16 || kind == KV_I8) {
        paired_accumulate(G, kind, acc, p, ld, v, stride, n, D, sc, sc_stride);
        return;
    }
#endif
    for (int32_t c = 0; c < D; c += 2 * VEC_WIDTH) {
        vf a0[8], a1[8];
        for (int g = 0; g < G; g++) {
            a0[g] = vf_load(acc + g * D + c);
            a1[g] = vf_load(acc + g * D + c + VEC_WIDTH);
        }
        for (int32_t j = 0; j < n; j++) {
            const vf v0 = load_kv(v, j * stride + c, kind), v1 = load_kv(v, j * stride + c + VEC_WIDTH, kind);
            for (int g = 0; g < G; g++) {
                const vf pj = vf_set1(p[g * ld + j]);
                a0[g] = vf_fma(pj, v0, a0[g]);
                a1[g] = vf_fma(pj, v1, a1[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            vf_store(acc + g * D + c, a0[g]);
            vf_store(acc + g * D + c + VEC_WIDTH, a1[g]);
        }
    }
}

#define DISPATCH_G(G, CALL)                                         \
    switch (G) {                                                    \
        case 1: { const int G_ = 1; CALL; } break;                  \
        case 2: { const int G_ = 2; CALL; } break;                  \
        case 4: { const int G_ = 4; CALL; } break;                  \
        default: { const int G_ = 8; CALL; } break;                 \
    }
/* Column chunks: two vectors for PV; the AVX512-BF16 score and PV paths work in 32-column chunks too. */
#define FAST_D_MULTIPLE (2 * VEC_WIDTH > 32 ? 2 * VEC_WIDTH : 32)
#else
#define FAST_PATH 0
#define PAIRED_PV 0
#define FAST_D_MULTIPLE 1
static inline int paired_index(int32_t d) { return d; }
#endif

/* ---- one sequence's G query rows of one KV head: state, one block, the result --------------------------- */

typedef struct {
    float *qf, *acc, *m, *l;       /* q * scale [G*D]; running P.V [G*D]; running max and sum [G] */
    uint16_t *qb;                  /* q * scale in bf16 [G*D]: the AVX512-BF16 scores only */
    const int32_t *table;
    int32_t seq_len, lo;           /* visible keys [lo, seq_len) */
} rows_t;

static inline __attribute__((always_inline)) void rows_init(rows_t *r, const void *q, int64_t q0, int32_t G,
                                                            int32_t D, float scale, const int is_bf16) {
    for (int32_t i = 0; i < G * D; i++) {
        r->qf[i] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[q0 + i]) : ((const float *)q)[q0 + i]) * scale;
        r->qb[i] = f32_to_bf16(r->qf[i]);
        r->acc[i] = 0.0f;
    }
    for (int32_t g = 0; g < G; g++) { r->m[g] = -INFINITY; r->l[g] = 0.0f; }
}

/* Block b of one sequence: scores, online-softmax update, P.V. `prefetch`: also fetch the next block's rows
 * (only the first sequence of a shared block asks; the others find it in cache). s [G*bs] and tile [bs*D] are
 * scratch. */
static inline __attribute__((always_inline)) void rows_visit(
        rows_t *r, int32_t b, const char *kc, const char *vc, int32_t G, int32_t D, int32_t bs, int64_t tok_stride,
        int32_t h, int fast, int prefetch, float *s, float *tile, const int kind) {
    const int32_t esize = kind == KV_BF16 ? 2 : (kind == KV_I8 ? 1 : 4);
    const int64_t hkv = tok_stride / D;
    /* elements (bytes, for int8) per block: an int8 block ends with its bs x Hkv float32 scales */
    const int64_t ng = D / I8_GROUP, sc_bytes = 4 * (int64_t)bs * hkv * ng;   /* int8: scales per row, per block */
    const int64_t bstride = bs * tok_stride + (kind == KV_I8 ? sc_bytes : 0);
    int32_t n, slot;
    const int64_t base = block_rows(r->table, b, r->lo, r->seq_len, bs, tok_stride, bstride, h, D, &n, &slot);
    /* the next block's keys now and its values after the scores: hides the scattered-block latency */
    const int pf = prefetch && b + 1 < (r->seq_len + bs - 1) / bs;
    const int64_t next = pf ? (int64_t)r->table[b + 1] * bstride + (int64_t)h * D : 0;
    if (pf) {
        prefetch_rows(kc + next * esize, tok_stride * esize, bs, D * esize);
        if (kind == KV_I8) prefetch_rows(kc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
    }
    const void *kb = kc + base * esize, *vb = vc + base * esize;
    /* int8: the first visible row's scales (D / 32 per row; the next token's Hkv * D / 32 floats on) */
    const int64_t sc_off = base - (int64_t)slot * tok_stride - (int64_t)h * D + bs * tok_stride
                           + 4 * ((int64_t)slot * hkv + h) * ng;
    const float *ksc = kind == KV_I8 ? (const float *)(kc + sc_off) : NULL;
    const float *vsc = kind == KV_I8 ? (const float *)(vc + sc_off) : NULL;
    const int64_t sc_stride = hkv * ng;
#if defined(__AVX512BF16__)
    const int i8_tile = 0;        /* int8 rows go straight into the bf16 dot products (load_bh32) */
#else
    const int i8_tile = 1;        /* int8 rows are widened into the float32 tile, then the float32 paths */
#endif
    if (fast && !(kind == KV_I8 && i8_tile)) {
#if FAST_PATH
        DISPATCH_G(G, fast_scores(G_, kind, r->qf, r->qb, kb, tok_stride, n, D, s, bs, ksc, sc_stride));
        if (pf) {
            prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
            if (kind == KV_I8) prefetch_rows(vc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
        }
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        DISPATCH_G(G, fast_accumulate(G_, kind, r->acc, s, bs, vb, tok_stride, n, D, vsc, sc_stride));
#endif
    } else if (fast) {
#if FAST_PATH
        widen(kb, tok_stride, n, D, tile, kind, ksc, sc_stride);
        DISPATCH_G(G, fast_scores(G_, KV_F32, r->qf, r->qb, tile, D, n, D, s, bs, NULL, 0));
        if (pf) {
            prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
            prefetch_rows(vc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
        }
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        widen(vb, tok_stride, n, D, tile, kind, vsc, sc_stride);
        DISPATCH_G(G, fast_accumulate(G_, KV_F32, r->acc, s, bs, tile, D, n, D, NULL, 0));
#endif
    } else {
        if (pf) prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
        widen(kb, tok_stride, n, D, tile, kind, ksc, sc_stride);
        tile_scores(r->qf, tile, G, n, D, s, bs);
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        widen(vb, tok_stride, n, D, tile, kind, vsc, sc_stride);
        tile_accumulate(r->acc, s, tile, G, n, D, bs);
    }
}

static inline __attribute__((always_inline)) void rows_finish(const rows_t *r, void *out, int64_t q0, int32_t G,
                                                              int32_t D, int permuted, const int is_bf16) {
#if PAIRED_PV
    if (permuted) {   /* paired_index's order undone two vectors at a time (vpermt2ps), not element by element */
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
        return;
    }
#endif
    for (int32_t g = 0; g < G; g++) {
        const float inv = r->l[g] > 0.0f ? 1.0f / r->l[g] : 0.0f;
        for (int32_t d = 0; d < D; d++) {
            const float x = r->acc[g * D + (permuted ? paired_index(d) : d)] * inv;
            if (is_bf16) ((uint16_t *)out)[q0 + g * D + d] = f32_to_bf16(x);
            else ((float *)out)[q0 + g * D + d] = x;
        }
    }
}

/* ---- one work item: a group of sequences (sharing leading blocks, or one alone) x one KV head ----------- *
 *
 * Sequences that share a prompt prefix share its physical blocks. Visiting them sequence by sequence reads
 * each shared block from memory once per sequence; here the blocks every member sees whole are visited block
 * by block, each member in turn, so a shared block comes from memory once and from cache for the others.
 * Every member still visits its own blocks in increasing order with its own state and the same arithmetic, so
 * its result is bit-identical to computing it alone:
 *
 *     member i:  [first_i .. j0)  alone      (window start: partly visible, or not shared by all)
 *                [j0 .. j1)       together   (shared by every member, wholly visible to each)
 *                [j1 .. end_i)    alone      (its own blocks)
 */
static inline __attribute__((always_inline)) void group_item(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t table_stride,
        const int32_t *seq_lens, const int32_t *members, int32_t count, int32_t num_heads, int32_t num_kv_heads,
        int32_t G, int32_t D, int32_t bs, int32_t window, float scale, int32_t h, void *out, const int kind,
        const int io_bf16) {
    float s[G * bs], tile[bs * D];
    const size_t per = (size_t)G * D;
    float *fbuf = (float *)malloc(sizeof(float) * count * (2 * per + 2 * G));
    uint16_t *hbuf = (uint16_t *)malloc(sizeof(uint16_t) * count * per);
    rows_t rows[MAX_MEMBERS];
    const int fast = FAST_PATH && D % FAST_D_MULTIPLE == 0 && (G == 1 || G == 2 || G == 4 || G == 8);
    const int64_t tok_stride = (int64_t)num_kv_heads * D;
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    int32_t j0 = 0, j1 = INT32_MAX;
    for (int32_t c = 0; c < count; c++) {
        const int32_t i = members[c], len = seq_lens[i];
        rows_t *r = &rows[c];
        r->qf = fbuf + c * (2 * per + 2 * G);
        r->acc = r->qf + per;
        r->m = r->acc + per;
        r->l = r->m + G;
        r->qb = hbuf + c * per;
        r->table = block_tables + i * table_stride;
        r->seq_len = len;
        r->lo = (window > 0 && len > window) ? len - window : 0;
        rows_init(r, q, ((int64_t)i * num_heads + (int64_t)h * G) * D, G, D, scale, io_bf16);
        const int32_t first_whole = (r->lo + bs - 1) / bs, last_whole = len / bs;
        j0 = first_whole > j0 ? first_whole : j0;
        j1 = last_whole < j1 ? last_whole : j1;
    }
    if (count > 1) {                                   /* shared: the same physical block in every member */
        int32_t b = j0;
        for (; b < j1; b++) {
            const int32_t phys = rows[0].table[b];
            int same = 1;
            for (int32_t c = 1; c < count && same; c++) same = rows[c].table[b] == phys;
            if (!same) break;
        }
        j1 = b;
    }
    if (j1 < j0) j1 = j0;
    for (int32_t c = 0; c < count; c++)
        for (int32_t b = rows[c].lo / bs; b < j0 && b * bs < rows[c].seq_len; b++)
            rows_visit(&rows[c], b, kc, vc, G, D, bs, tok_stride, h, fast, 1, s, tile, kind);
    for (int32_t b = j0; b < j1; b++)
        for (int32_t c = 0; c < count; c++)
            rows_visit(&rows[c], b, kc, vc, G, D, bs, tok_stride, h, fast, c == 0, s, tile, kind);
    const int permuted = fast && PAIRED_PV && (kind == KV_BF16 || kind == KV_I8);   /* PAIRED_PV: AVX512-BF16 */
    for (int32_t c = 0; c < count; c++) {
        rows_t *r = &rows[c];
        const int32_t from = j1 > r->lo / bs ? j1 : r->lo / bs;
        for (int32_t b = from; b * bs < r->seq_len; b++)
            rows_visit(r, b, kc, vc, G, D, bs, tok_stride, h, fast, 1, s, tile, kind);
        rows_finish(r, out, ((int64_t)members[c] * num_heads + (int64_t)h * G) * D, G, D, permuted, io_bf16);
    }
    free(fbuf);
    free(hbuf);
}

/* One work item's function per (cache kind, query/output dtype): a constant kind and io_bf16 each, so group_item's
 * always-inline paths specialize. bf16kv_f32: float32 queries and outputs over a bf16 cache (float32 activations,
 * kv_cache_dtype: bfloat16); i8kv_*: an int8 cache (kv_cache_dtype: int8). */
#define GROUP_ITEM(NAME, KIND, IO_BF16)                                                                          \
    static void NAME(const void *q, const void *k, const void *v, const int32_t *bt, int64_t ts,                \
                     const int32_t *lens, const int32_t *members, int32_t count, int32_t hq, int32_t hkv,       \
                     int32_t G, int32_t D, int32_t bs, int32_t window, float scale, int32_t h, void *out) {     \
        group_item(q, k, v, bt, ts, lens, members, count, hq, hkv, G, D, bs, window, scale, h, out, KIND,       \
                   IO_BF16);                                                                                     \
    }
GROUP_ITEM(group_item_bf16, KV_BF16, 1)
GROUP_ITEM(group_item_f32, KV_F32, 0)
GROUP_ITEM(group_item_bf16kv_f32, KV_BF16, 0)
GROUP_ITEM(group_item_i8kv_f32, KV_I8, 0)
GROUP_ITEM(group_item_i8kv_bf16, KV_I8, 1)

/* ---- grouping: sequences sorted by their block tables, cut into runs that start on the same block -------- */

typedef struct {
    const int32_t *tables;
    int64_t stride;
    const int32_t *lens;
    int32_t bs;
} tables_t;

/* Lexicographic order of two sequences' block tables (over the blocks both have), then index. */
static int table_less(const tables_t *t, int32_t a, int32_t b) {
    const int32_t na = (t->lens[a] + t->bs - 1) / t->bs, nb = (t->lens[b] + t->bs - 1) / t->bs;
    const int32_t n = na < nb ? na : nb;
    const int32_t *ta = t->tables + a * t->stride, *tb = t->tables + b * t->stride;
    for (int32_t j = 0; j < n; j++)
        if (ta[j] != tb[j]) return ta[j] < tb[j];
    return a < b;
}

/* order[0..n) sorted by table_less: a stable bottom-up merge sort (n is the decode batch, at most a few hundred). */
static void sort_by_tables(const tables_t *t, int32_t *order, int32_t *tmp, int32_t n) {
    for (int32_t i = 0; i < n; i++) order[i] = i;
    for (int32_t w = 1; w < n; w *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * w) {
            const int32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = table_less(t, order[j], order[i]) ? order[j++] : order[i++];
            while (i < mid) tmp[k++] = order[i++];
            while (j < hi) tmp[k++] = order[j++];
        }
        memcpy(order, tmp, sizeof(int32_t) * n);
    }
}

/* Cut the sorted order into groups: a new group where the first block changes, or at `cap` members.
 * starts[g] .. starts[g + 1] index `order`; returns the number of groups. */
static int32_t cut_groups(const tables_t *t, const int32_t *order, int32_t n, int32_t cap, int32_t *starts) {
    int32_t groups = 0;
    for (int32_t i = 0; i < n; i++) {
        const int new_run = i == 0 || t->tables[order[i] * t->stride] != t->tables[order[i - 1] * t->stride];
        if (new_run || i - starts[groups - 1] >= cap) starts[groups++] = i;
    }
    starts[groups] = n;
    return groups;
}

/* ---- entry points --------------------------------------------------------------------------------------- */

/* Members per group: enough groups to keep every thread busy (about four items per thread), at most
 * MAX_MEMBERS. A shared block is then read from memory once per group instead of once per sequence. */

#define ENTRY(NAME, T, TC, ITEM)                                                                                 \
    int NAME(const T *q, const TC *k_cache, const TC *v_cache, const int32_t *block_tables, int64_t table_stride,\
             const int32_t *seq_lens, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,               \
             int32_t head_dim, int32_t block_size, int32_t window, float scale, T *out, int32_t num_threads) { \
        if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP              \
            || block_size < 1 || block_size > MAX_BLOCK || head_dim < 1)                                      \
            return 1;                                                                                         \
        if (num_seqs < 1) return 0;                                                                           \
        const int32_t G = num_heads / num_kv_heads;                                                           \
        int32_t *order = (int32_t *)malloc(sizeof(int32_t) * (3 * (size_t)num_seqs + 1));                     \
        int32_t *tmp = order + num_seqs, *starts = tmp + num_seqs;                                            \
        const tables_t t = {block_tables, table_stride, seq_lens, block_size};                                \
        sort_by_tables(&t, order, tmp, num_seqs);                                                             \
        const int32_t want = 4 * (num_threads > 0 ? num_threads : 1);                                         \
        int32_t cap = (num_seqs * num_kv_heads + want - 1) / want;                                            \
        cap = cap < 1 ? 1 : (cap > MAX_MEMBERS ? MAX_MEMBERS : cap);                                          \
        const int32_t groups = cut_groups(&t, order, num_seqs, cap, starts);                                  \
        const int64_t items = (int64_t)groups * num_kv_heads;                                                 \
        (void)num_threads;                                                                                    \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t it = 0; it < items; it++) {                                                              \
            const int32_t g = (int32_t)(it / num_kv_heads);                                                   \
            ITEM(q, k_cache, v_cache, block_tables, table_stride, seq_lens, order + starts[g],                \
                 starts[g + 1] - starts[g], num_heads, num_kv_heads, G, head_dim, block_size, window, scale,   \
                 (int32_t)(it % num_kv_heads), out);                                                          \
        }                                                                                                     \
        free(order);                                                                                          \
        return 0;                                                                                             \
    }

ENTRY(paged_decode_bf16, uint16_t, uint16_t, group_item_bf16)
ENTRY(paged_decode_f32, float, float, group_item_f32)
ENTRY(paged_decode_bf16kv_f32, float, uint16_t, group_item_bf16kv_f32)
ENTRY(paged_decode_i8kv_f32, float, int8_t, group_item_i8kv_f32)
ENTRY(paged_decode_i8kv_bf16, uint16_t, int8_t, group_item_i8kv_bf16)
