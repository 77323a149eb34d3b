/* Prefill attention, one sequence's chunk in one call: for every KV head and tile of queries, scores = q k^T
 * (float32), the causal / sliding-window softmax, out = p v (float32), all on one thread per work item, the items
 * spread over OpenMP threads. Two operand kinds: a bf16 KV cache on AVX512-BF16 CPUs (prefill_bf16kv_*: bf16 dot
 * products, bf16_gemm/), and float32 throughout (prefill_f32: FMA micro-kernel of 6 rows x 2 vectors, vec.h at the
 * AVX2 or AVX-512 width; from 1.4x on the avx2 build to 2.3x on Zen 4 faster than the torch tiles it replaces).
 *
 * Why: the same tiles composed in Python (as tests/test_bf16_prefill.py composes them) make four parallel regions
 * per 128-query tile (two bf16_gemm calls, the softmax, torch's cast of the probabilities to bf16) and allocate and
 * write every intermediate through memory: on Zen 4 with two threads they ran at ~230 (sliding) and ~290 (global)
 * GFLOP/s of useful work against 445 for bf16_gemm alone. Here each item stays in its thread's caches and the
 * threads never wait on each other inside a tile.
 *
 * The arithmetic is the Python-composed tiles', bit for bit: the same bf16 x bf16 -> float32 micro-kernel (bf16_gemm/)
 * over the same dot products, the same softmax (masked_softmax.c's masked_softmax_f32), probabilities rounded to
 * bf16 once. A tile's key columns start at an even offset (value pairs) and the extra keys are invisible:
 * probability 0, which adds exact zeros.
 *
 * Layouts (elements), bf16 kind:
 *   q    [n, Hq, D] bf16, already multiplied by the softmax scale (rows: token t, head h * G + g)
 *   kp   [Hkv][D/2, ldk] int32 words: kp[h][i][j] = (k[j][2i], k[j][2i+1]) for key j of the chunk's S keys
 *   vp   [Hkv][S/2, D]   int32 words: vp[h][j][d] = (v[2j][d], v[2j+1][d]); S even (the caller pads)
 *   out  [n, Hq, D] float32 or bf16
 * Key j is at position k_start + j; query i at q_start + i. Query q sees keys q - window < k <= q (window > 0),
 * or k <= q.
 *
 * This header is what the implementations share: everything but the float32 tile product. An implementation file
 * defines F32_COLS, includes this header, then defines f32_gemm_serial (declared below).
 */
#ifndef BATCHGEN_PREFILL_DRIVER_H
#define BATCHGEN_PREFILL_DRIVER_H

#include <stdint.h>
#include <stdlib.h>

#include "../bf16_gemm/bf16_gemm.h"

#define PREFILL_BF16_ALIGN 32   /* keys; engine/attention/torch_backend.py _prefill_wide aligns its base the same */
#include "../common.h"
#include "../kernels.h"

#define TILE_ROWS 128   /* query rows (token x head-in-group) per work item: a 128 x S' float32 score tile */

/* masked_softmax_f32 (kernels.h, masked_softmax.c): the same function the torch-driven tiles call; inside a work
 * item it runs on the calling thread. */

/* ---- each implementation defines -------------------------------------------------------------------------- */

/* c[M, N] = a[M, K] @ b[K, N], float32, row-major, on the calling thread; N a multiple of F32_COLS (the callers
 * pad) */
static void f32_gemm_serial(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int M,
                            int N, int K);

/* ---- the chunk ------------------------------------------------------------------------------------------ */

/* F32 0 (bf16 cache): q bf16, k/v packed pairs (kp [Hkv][D/2, ldk], vp [Hkv][S/2, D]), tiles' key columns start
 *   at even offsets.
 * F32 1 (float32 everything): q float32, k transposed (kt [Hkv][D, ldk]) and v [Hkv][S, D] float32, S a multiple
 *   of F32_COLS (zero keys and values at the end), tiles' key columns start at multiples of F32_COLS and run in
 *   whole multiples.
 * Extra columns either side of what a tile sees are masked (probability 0). */
static inline __attribute__((always_inline)) void prefill(
        const int F32, const void *q, const void *kop, int64_t ldk, const void *vop, int n, int Hq, int Hkv, int D,
        int S, int64_t q_start, int64_t k_start, int64_t window, void *out, int out_bf16, int nt) {
    /* a tile's first key at a multiple of align from k_start (the caller aligns k_start to absolute positions): the
     * float32 kernel's column tiles, and for bf16 32 keys, AMX's 16 pairs per TDPBF16PS (its sums within an
     * instruction are not in pair order: a chunk boundary that moved with the tile changed the bits) */
    const int G = Hq / Hkv, qsize = F32 ? 4 : 2, align = F32 ? F32_COLS : PREFILL_BF16_ALIGN;
    /* query tokens per item: TILE_ROWS rows, fewer (down to 16) while there are under four items per thread, so
     * a short chunk still keeps every thread busy (two items for 37 tokens ran at 0.85x the Python-composed
     * tiles' speed) */
    int tq = TILE_ROWS / G > 0 ? TILE_ROWS / G : 1;
    const int nthreads = nt > 0 ? nt : 1;
    while (tq * G > 16 && tq > 1 && (int64_t)Hkv * ((n + tq - 1) / tq) < 4 * nthreads) tq = (tq + 1) / 2;
    const int tiles = (n + tq - 1) / tq, rows_max = tq * G;
    const int64_t items = (int64_t)Hkv * tiles;
#pragma omp parallel num_threads(nt) if (items > 1)
    {
        /* per thread: the tile's queries (dense rows), scores (softmaxed in place), bf16 probabilities (the bf16
         * kind only) and output */
        char *qt = (char *)malloc((size_t)qsize * rows_max * D);
        float *sc = (float *)malloc(sizeof(float) * (size_t)rows_max * (S + align));
        uint16_t *pb = F32 ? NULL : (uint16_t *)malloc(sizeof(uint16_t) * (size_t)rows_max * (S + align));
        float *ob = (float *)malloc(sizeof(float) * (size_t)rows_max * D);
        /* each KV head's query tiles latest first (the most keys under a causal mask), so the dynamic schedule
         * ends on short items and neither thread waits long at the end (in order, the longest came last); heads
         * one after another, so consecutive items share a head's keys and values in L2 (interleaving the heads
         * lost that with 8 KV heads). An item's bits do not depend on when it runs. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int h = (int)(it / tiles), t0 = (int)(tiles - 1 - it % tiles) * tq;
            const int t = n - t0 < tq ? n - t0 : tq, rows = t * G;
            const int64_t ts = q_start + t0, te = ts + t;                  /* query positions [ts, te) */
            const int64_t lo = window > 0 && ts - window + 1 > k_start ? ts - window + 1 : k_start;
            const int64_t j0 = (lo - k_start) / align * align;
            int64_t j1 = j0 + (te - k_start - j0 + align - 1) / align * align;
            if (j1 > S) j1 = S;
            const int64_t nc = j1 - j0;
            for (int i = 0; i < t; i++)
                memcpy(qt + (size_t)qsize * i * G * D, (const char *)q + (size_t)qsize * ((t0 + i) * Hq + h * G) * D,
                       (size_t)qsize * G * D);
            if (F32) {
                const float *kt = (const float *)kop + (size_t)h * D * ldk, *v = (const float *)vop + (size_t)h * S * D;
                f32_gemm_serial((const float *)qt, D, kt + j0, ldk, sc, nc, rows, (int)nc, D);
                masked_softmax_f32(sc, 1, t, G, nc, ts, k_start + j0, window, 1);
                f32_gemm_serial(sc, nc, v + j0 * D, D, ob, D, rows, D, (int)nc);
            } else if (!bf16_attention_amx((const uint16_t *)qt, rows, G, ts, (const uint32_t *)kop + (size_t)h * (D / 2) * ldk,
                                           ldk, (const uint32_t *)vop + (size_t)h * S / 2 * D, S, D, k_start, window,
                                           ob)) {
                const uint32_t *kp = (const uint32_t *)kop + (size_t)h * (D / 2) * ldk;
                const uint32_t *vp = (const uint32_t *)vop + ((size_t)h * S + j0) / 2 * D;
                bf16_gemm_serial((const uint16_t *)qt, D, kp + j0, ldk, sc, nc, rows, (int)nc, D / 2);
                masked_softmax_f32(sc, 1, t, G, nc, ts, k_start + j0, window, 1);
                for (int64_t x = 0; x < (int64_t)rows * nc; x++) pb[x] = f32_to_bf16(sc[x]);  /* P enters in bf16 */
                bf16_gemm_serial(pb, nc, vp, D, ob, D, rows, D, (int)(nc / 2));
            }
            for (int i = 0; i < t; i++) {
                const size_t o = ((size_t)(t0 + i) * Hq + (size_t)h * G) * D;
                const float *src = ob + (size_t)i * G * D;
                if (out_bf16)
                    for (int x = 0; x < G * D; x++) ((uint16_t *)out)[o + x] = f32_to_bf16(src[x]);
                else
                    memcpy((float *)out + o, src, sizeof(float) * G * D);
            }
        }
        free(qt);
        free(sc);
        free(pb);
        free(ob);
    }
}

void prefill_bf16kv_f32(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq,
                        int Hkv, int D, int S, int64_t q_start, int64_t k_start, int64_t window, float *out,
                        int nt) {
    prefill(0, q, kp, ldk, vp, n, Hq, Hkv, D, S, q_start, k_start, window, out, 0, nt);
}

void prefill_bf16kv_bf16(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq,
                         int Hkv, int D, int S, int64_t q_start, int64_t k_start, int64_t window, uint16_t *out,
                         int nt) {
    prefill(0, q, kp, ldk, vp, n, Hq, Hkv, D, S, q_start, k_start, window, out, 1, nt);
}

/* float32 queries, keys (transposed), values and output; D a multiple of F32_COLS (prefill_f32_cols()) */
void prefill_f32(const float *q, const float *kt, int64_t ldk, const float *v, int n, int Hq, int Hkv, int D, int S,
                 int64_t q_start, int64_t k_start, int64_t window, float *out, int nt) {
    prefill(1, q, kt, ldk, v, n, Hq, Hkv, D, S, q_start, k_start, window, out, 0, nt);
}

int prefill_f32_cols(void) { return F32_COLS; }


/* ---- the chunk's keys and values straight from the paged bf16 cache into the bf16 kind's operands ---------- *
 * Positions [lo, hi) of one sequence (block table `table`, cache [blocks, bs, Hkv, D]); S = hi - lo rounded up to
 * even, the extra key zero. kp [Hkv][D/2, S]: word (i, j) = key j's pair i; vp [Hkv][S/2, D]: word (j, d) = (v[2j][d],
 * v[2j+1][d]). One pass over the cache where torch made a gather, a pad, and a transpose copy per head. The keys'
 * transpose goes 32 keys at a time (their rows stay in L1): each pair i then writes 128 contiguous bytes, where a
 * key at a time wrote 4 bytes into each of D/2 lines S words apart. */
#define PACK_KEYS 32

/* the cached row of position pos for KV head h, or NULL past hi (the padding key) */
static inline const uint16_t *cached_row(const uint16_t *cache, const int32_t *table, int bs, int64_t tok, int h,
                                         int D, int64_t pos, int64_t hi) {
    return pos < hi ? cache + ((int64_t)table[pos / bs] * bs + pos % bs) * tok + (int64_t)h * D : NULL;
}

void pack_kv_bf16(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int bs, int Hkv, int D,
                  int64_t lo, int64_t hi, uint32_t *kp, uint32_t *vp, int nt) {
    const int64_t S = (hi - lo + 1) / 2 * 2, D2 = D / 2, kblocks = (S + PACK_KEYS - 1) / PACK_KEYS;
    const int64_t tok = (int64_t)Hkv * D;                                  /* elements per cached token */
    (void)nt;
#pragma omp parallel num_threads(nt) if (S * D > 65536)
    {
#pragma omp for collapse(2) schedule(static) nowait
        for (int h = 0; h < Hkv; h++)
            for (int64_t kb = 0; kb < kblocks; kb++) {                     /* keys: PACK_KEYS at a time */
                const int64_t j0 = kb * PACK_KEYS, n = S - j0 < PACK_KEYS ? S - j0 : PACK_KEYS;
                const uint16_t *kr[PACK_KEYS];
                for (int64_t j = 0; j < n; j++) kr[j] = cached_row(k_cache, table, bs, tok, h, D, lo + j0 + j, hi);
                uint32_t *kd = kp + (size_t)h * D2 * S + j0;
                for (int64_t i = 0; i < D2; i++)
                    for (int64_t j = 0; j < n; j++) {
                        uint32_t w = 0;
                        if (kr[j]) memcpy(&w, kr[j] + 2 * i, sizeof w);
                        kd[i * S + j] = w;
                    }
            }
#pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < Hkv; h++)
            for (int64_t j2 = 0; j2 < S / 2; j2++) {                       /* values: a pair of keys per row */
                const uint16_t *v0 = cached_row(v_cache, table, bs, tok, h, D, lo + 2 * j2, hi);
                const uint16_t *v1 = cached_row(v_cache, table, bs, tok, h, D, lo + 2 * j2 + 1, hi);
                uint32_t *vd = vp + ((size_t)h * (S / 2) + j2) * D;
                for (int d = 0; d < D; d++)
                    vd[d] = (uint32_t)(v0 ? v0[d] : 0) | (uint32_t)(v1 ? v1[d] : 0) << 16;
            }
    }
}

/* pack_kv_bf16's operands from an int8 cache (kv_cache_dtype: int8; block layout in kv_write.c): each value is
 * its quant times its group's scale, rounded to bf16 once (what the bf16 kernel multiplies; the decode kernel
 * rounds the same way). Its own loops, not pack_kv_bf16's with a
 * row-kind switch: that shared version ran pack_kv_bf16 slower (its word loads and vectorized value rows lost;
 * docs/perf/code-notes-kernels.md). */
static inline const int8_t *i8_row(const int8_t *cache, const int32_t *table, int bs, int Hkv, int h, int D,
                                   int64_t pos, int64_t hi, const float **scales) {
    if (pos >= hi) return NULL;
    const int64_t ng = D / I8_GROUP, rows = (int64_t)bs * Hkv * D;
    const int64_t blk = (int64_t)table[pos / bs] * (rows + 4 * (int64_t)bs * Hkv * ng);
    const int64_t r = (pos % bs) * Hkv + h;
    *scales = (const float *)(cache + blk + rows) + r * ng;     /* 4-byte aligned: rows and blocks are */
    return cache + blk + r * D;
}

static inline uint32_t i8_bf16(const int8_t *row, const float *sc, int d) {
    return row ? f32_to_bf16((float)row[d] * sc[d / I8_GROUP]) : 0;
}

void pack_kv_i8(const int8_t *k_cache, const int8_t *v_cache, const int32_t *table, int bs, int Hkv, int D,
                int64_t lo, int64_t hi, uint32_t *kp, uint32_t *vp, int nt) {
    const int64_t S = (hi - lo + 1) / 2 * 2, D2 = D / 2, kblocks = (S + PACK_KEYS - 1) / PACK_KEYS;
    (void)nt;
#pragma omp parallel num_threads(nt) if (S * D > 65536)
    {
#pragma omp for collapse(2) schedule(static) nowait
        for (int h = 0; h < Hkv; h++)
            for (int64_t kb = 0; kb < kblocks; kb++) {                     /* keys: PACK_KEYS at a time */
                const int64_t j0 = kb * PACK_KEYS, n = S - j0 < PACK_KEYS ? S - j0 : PACK_KEYS;
                const int8_t *kr[PACK_KEYS];
                const float *ks[PACK_KEYS];
                for (int64_t j = 0; j < n; j++) kr[j] = i8_row(k_cache, table, bs, Hkv, h, D, lo + j0 + j, hi, &ks[j]);
                uint32_t *kd = kp + (size_t)h * D2 * S + j0;
                for (int64_t i = 0; i < D2; i++)
                    for (int64_t j = 0; j < n; j++)
                        kd[i * S + j] = i8_bf16(kr[j], ks[j], 2 * i) | i8_bf16(kr[j], ks[j], 2 * i + 1) << 16;
            }
#pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < Hkv; h++)
            for (int64_t j2 = 0; j2 < S / 2; j2++) {                       /* values: a pair of keys per row */
                const float *s0 = NULL, *s1 = NULL;
                const int8_t *v0 = i8_row(v_cache, table, bs, Hkv, h, D, lo + 2 * j2, hi, &s0);
                const int8_t *v1 = i8_row(v_cache, table, bs, Hkv, h, D, lo + 2 * j2 + 1, hi, &s1);
                uint32_t *vd = vp + ((size_t)h * (S / 2) + j2) * D;
                for (int d = 0; d < D; d++) vd[d] = i8_bf16(v0, s0, d) | i8_bf16(v1, s1, d) << 16;
            }
    }
}

#endif
