/* y[M, N] = x[M, K] @ w[N, K]^T for the rows of output positions: the decode-time LM head and, as the ``linears``
 * kernel family, every float linear's decode rows. torch's matmul at such M runs far below both the memory and
 * the compute limit (docs/perf/code-notes-kernels.md, docs/perf/avx2.md) and pads rows for invariance. Here each
 * weight row is read from memory once per call and dotted with every x row in register tiles of TM x TN dots
 * (a block of KB columns of every x row stays in L2), so few rows are memory-bound and many rows near the FMA
 * peak; a row's bits do not depend on the row count. bf16 (x, w, y bf16; float32 accumulation), float32, or
 * float32 x and y over bf16 weights (read as float32: the same bits as their float32 copy, half the bytes), per
 * implementation:
 *   avx512_bf16.c: vdpbf16ps on bf16 pairs (float32: as avx512.c); avx2.c, avx512.c: widen to float32 + FMA
 *   (vec.h); portable.c: scalar.
 *
 * This header is what the implementations share. An implementation file includes it, then defines tile_head
 * (declared below). */
#ifndef BATCHGEN_SMALL_M_DRIVER_H
#define BATCHGEN_SMALL_M_DRIVER_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "../common.h"
#include "../kernels.h"

#define TM 4          /* x rows per tile */
#define TN 3          /* weight rows per tile: TM x TN float32 accumulators (12 of AVX2's 16 registers) */
#define KB 1024       /* columns per block: a block of every x row stays in L2 while weight rows stream past it */
#define NC_MAX 96     /* weight rows per chunk (a thread's unit of work) at most */

static inline float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- each implementation defines ------------------------------------------------------------------------ */

/* The dots of R x rows (from row m0) with C weight rows (from row n0) over columns [k0, k0 + c), c returned: the
 * same c for every tile of a block (0 where the implementation has no vector loop), into sums[r][j]; tile adds
 * the rest. R and C are compile-time constants at every call (always_inline). */
static int32_t tile_head(const int R, const int C, const void *x, int64_t m0, const void *w, int64_t n0, int32_t K,
                         int32_t k0, int32_t len, int xb, int wb, float sums[TM][TN]);

/* One tile's dots over the block [k0, k0 + len): the vector part, then the remaining columns in order. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const void *x, int64_t m0,
                                                       const void *w, int64_t n0, int32_t K, int32_t k0,
                                                       int32_t len, int xb, int wb, float sums[TM][TN]) {
    const int32_t c = tile_head(R, C, x, m0, w, n0, K, k0, len, xb, wb, sums);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float s = c ? sums[r][j] : 0.0f;
            for (int32_t k = k0 + c; k < k0 + len; k++)
                s += load1(x, (m0 + r) * K + k, xb) * load1(w, (n0 + j) * K + k, wb);
            sums[r][j] = s;
        }
}

#define TILE_CASE(R, C) case (R) * 8 + (C): tile(R, C, x, m0, w, nb, K, k0, len, xb, wb, s); break;

/* The blocks [k0, k0 + len) of weight rows n0 .. n0 + nn - 1 with every x row, added into acc [M, nn]. */
static void block(const void *x, int32_t M, int32_t K, const void *w, int64_t n0, int64_t nn, int32_t k0,
                  int32_t len, int xb, int wb, float *acc) {
    for (int64_t j0 = 0; j0 < nn; j0 += TN) {
        const int C = nn - j0 < TN ? (int)(nn - j0) : TN;
        for (int64_t m0 = 0; m0 < M; m0 += TM) {
            const int R = M - m0 < TM ? (int)(M - m0) : TM;
            float s[TM][TN];
            const int64_t nb = n0 + j0;         /* the tile's first weight row */
            switch (R * 8 + C) {                /* constant R, C: unrolled, accumulators in registers */
            TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
            TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
            TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
            TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
            }
            for (int r = 0; r < R; r++)
                for (int j = 0; j < C; j++) {
                    float *a = acc + (m0 + r) * nn + j0 + j;
                    *a = k0 == 0 ? s[r][j] : *a + s[r][j];
                }
        }
    }
}

/* y[m, n] = the sum over K's blocks of KB columns, in order, of each block's dot: it depends on K alone, never on
 * M, N, the tiles or the threads, so a row gets the same bits at every row count (decode's batch invariance). */
static void small_m(const void *x, int32_t M, int32_t K, const void *w, int64_t N, void *y, int xb, int wb, int32_t nt) {
    int64_t nc = (N + 4 * (int64_t)nt - 1) / (4 * (int64_t)nt);      /* about four chunks a thread */
    nc = (nc + TN - 1) / TN * TN;
    nc = nc < TN ? TN : (nc > NC_MAX ? NC_MAX : nc);
    const int64_t chunks = (N + nc - 1) / nc;
#pragma omp parallel num_threads(nt)
    {
        float *acc = (float *)malloc((size_t)M * (size_t)nc * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t n0 = ch * nc, nn = N - n0 < nc ? N - n0 : nc;
            for (int32_t k0 = 0; k0 < K; k0 += KB)
                block(x, M, K, w, n0, nn, k0, K - k0 < KB ? K - k0 : KB, xb, wb, acc);
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < nn; j++) {
                    const float v = K ? acc[m * nn + j] : 0.0f;
                    if (xb) ((uint16_t *)y)[m * N + n0 + j] = f32_to_bf16(v);
                    else ((float *)y)[m * N + n0 + j] = v;
                }
        }
        free(acc);
    }
}

void small_m_linear_bf16(const uint16_t *x, int32_t M, int32_t K, const uint16_t *w, int64_t N, uint16_t *y,
                         int32_t nt) {
    small_m(x, M, K, w, N, y, 1, 1, nt);
}
void small_m_linear_f32(const float *x, int32_t M, int32_t K, const float *w, int64_t N, float *y, int32_t nt) {
    small_m(x, M, K, w, N, y, 0, 0, nt);
}
void small_m_linear_f32_bf16w(const float *x, int32_t M, int32_t K, const uint16_t *w, int64_t N, float *y,
                              int32_t nt) {
    small_m(x, M, K, w, N, y, 0, 1, nt);
}

#endif
