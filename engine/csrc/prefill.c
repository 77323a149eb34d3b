/* Prefill attention over a bf16 KV cache, one sequence's chunk in one call: for every KV head and tile of
 * queries, scores = q k^T (float32), the causal / sliding-window softmax, out = p v (float32), all on one thread
 * per work item, the items spread over OpenMP threads.
 *
 * Why: the same tiles driven from Python (engine/attention/torch_backend.py, _prefill_wide) made four parallel
 * regions per 128-query tile (two bf16_gemm calls, the softmax, torch's cast of the probabilities to bf16) and
 * allocated and wrote every intermediate through memory: on Zen 4 with two threads it ran at ~230 (sliding) and
 * ~290 (global) GFLOP/s of useful work against 445 for bf16_gemm alone. Here each item stays in its thread's
 * caches and the threads never wait on each other inside a tile.
 *
 * The arithmetic is _prefill_wide's, bit for bit: the same bf16 x bf16 -> float32 micro-kernel (bf16_gemm.c)
 * over the same dot products, the same softmax loop, probabilities rounded to bf16 once. A tile's key columns
 * start at an even offset (value pairs) and the extra keys are invisible: probability 0, which adds exact zeros.
 *
 * Layouts (elements):
 *   q    [n, Hq, D] bf16, already multiplied by the softmax scale (rows: token t, head h * G + g)
 *   kp   [Hkv][D/2, ldk] int32 words: kp[h][i][j] = (k[j][2i], k[j][2i+1]) for key j of the chunk's S keys
 *   vp   [Hkv][S/2, D]   int32 words: vp[h][j][d] = (v[2j][d], v[2j+1][d]); S even (the caller pads)
 *   out  [n, Hq, D] float32 or bf16
 * Key j is at position k_start + j; query i at q_start + i. Query q sees keys q - window < k <= q (window > 0),
 * or k <= q.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_gemm.h"
#include "common.h"

#define TILE_ROWS 128   /* query rows (token x head-in-group) per work item: a 128 x S' float32 score tile */

static void softmax_rows(const float *s, int64_t ld, int rows, int G, int64_t q0, int64_t k0, int64_t ncols,
                         int64_t window, uint16_t *p) {
    for (int r = 0; r < rows; r++) {
        const float *row = s + r * ld;
        uint16_t *pr = p + r * ncols;
        const int64_t q = q0 + r / G;
        int64_t j0 = window > 0 ? q - window + 1 - k0 : 0, j1 = q - k0 + 1;     /* visible columns [j0, j1) */
        j0 = j0 < 0 ? 0 : j0;
        j1 = j1 > ncols ? ncols : j1;
        float mx = -INFINITY;
        for (int64_t j = j0; j < j1; j++) mx = row[j] > mx ? row[j] : mx;
        float sum = 0.0f;
        float e[j1 > j0 ? j1 - j0 : 1];
#pragma omp simd reduction(+:sum)
        for (int64_t j = j0; j < j1; j++) {
            e[j - j0] = exp_clamped(row[j] - mx);
            sum += e[j - j0];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t j = 0; j < j0; j++) pr[j] = 0;
#pragma omp simd
        for (int64_t j = j0; j < j1; j++) pr[j] = f32_to_bf16(e[j - j0] * inv);
        for (int64_t j = j1 > j0 ? j1 : j0; j < ncols; j++) pr[j] = 0;
    }
}

static void prefill(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq, int Hkv,
                    int D, int S, int64_t q_start, int64_t k_start, int64_t window, void *out, int out_bf16,
                    int nt) {
    const int G = Hq / Hkv, D2 = D / 2;
    /* query tokens per item: TILE_ROWS rows, fewer (down to 16) while there are under four items per thread, so
     * a short chunk still keeps every thread busy (two items for 37 tokens ran 0.85x the old tiles' speed) */
    int tq = TILE_ROWS / G > 0 ? TILE_ROWS / G : 1;
    const int nthreads = nt > 0 ? nt : 1;
    while (tq * G > 16 && tq > 1 && (int64_t)Hkv * ((n + tq - 1) / tq) < 4 * nthreads) tq = (tq + 1) / 2;
    const int tiles = (n + tq - 1) / tq, rows_max = tq * G;
    const int64_t items = (int64_t)Hkv * tiles;
    (void)nt;
#pragma omp parallel num_threads(nt) if (items > 1)
    {
        /* per thread: the tile's queries (dense rows), scores, probabilities (bf16) and output */
        uint16_t *qt = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)rows_max * D);
        float *sc = (float *)malloc(sizeof(float) * (size_t)rows_max * (S + 2));
        uint16_t *pb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)rows_max * (S + 2));
        float *ob = (float *)malloc(sizeof(float) * (size_t)rows_max * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int h = (int)(it / tiles), t0 = (int)(it % tiles) * tq;
            const int t = n - t0 < tq ? n - t0 : tq, rows = t * G;
            const int64_t ts = q_start + t0, te = ts + t;                  /* query positions [ts, te) */
            int64_t lo = window > 0 && ts - window + 1 > k_start ? ts - window + 1 : k_start;
            const int64_t j0 = (lo - k_start) & ~(int64_t)1;               /* even: value pairs */
            int64_t j1 = te - k_start;
            j1 += (j1 - j0) & 1;
            if (j1 > S) j1 = S;
            const int64_t nc = j1 - j0;
            for (int i = 0; i < t; i++)
                memcpy(qt + (size_t)i * G * D, q + ((size_t)(t0 + i) * Hq + (size_t)h * G) * D,
                       sizeof(uint16_t) * G * D);
            bf16_gemm_serial(qt, D, kp + (size_t)h * D2 * ldk + j0, ldk, sc, nc, rows, (int)nc, D2);
            softmax_rows(sc, nc, rows, G, ts, k_start + j0, nc, window, pb);
            bf16_gemm_serial(pb, nc, vp + ((size_t)h * S + j0) / 2 * D, D, ob, D, rows, D, (int)(nc / 2));
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
    prefill(q, kp, ldk, vp, n, Hq, Hkv, D, S, q_start, k_start, window, out, 0, nt);
}

void prefill_bf16kv_bf16(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq,
                         int Hkv, int D, int S, int64_t q_start, int64_t k_start, int64_t window, uint16_t *out,
                         int nt) {
    prefill(q, kp, ldk, vp, n, Hq, Hkv, D, S, q_start, k_start, window, out, 1, nt);
}
