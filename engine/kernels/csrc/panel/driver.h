/* y[M, N] = x[M, K] @ w[N, K]^T, float32 x and y, over weights packed at load in panels of PANEL_NR output rows:
 * panel p holds rows p*16 .. p*16+15, k-major (for each column k, the 16 rows' values side by side), zero rows
 * past N. Each x value is broadcast and multiplied into a whole panel row, so a tile of up to PANEL_MR x rows by 16
 * weight rows keeps its 2 x PANEL_MR accumulators in registers and reads the weights once per tile: decode's rows
 * near the FMA peak where the dot-product kernel (small_m/) sums across vector lanes. Float32 panels store the 16
 * values in row order; bf16 panels (a bf16-exact weight: half the bytes, the same bits) in the order of PANEL_SLOT,
 * which AVX2's unpack-with-zero widens to rows 0-7 and 8-15 without a shuffle.
 *
 * Every y[m, n] is one float32 fused multiply-add chain over k = 0 .. K-1 in order, from zero: its bits depend on
 * x's row and w's row alone, never on M, the tiles or the threads (decode's batch invariance), and are the same in
 * every implementation (portable.c uses fmaf). An implementation file includes this header, then defines
 * panel_tile (declared below). */
#ifndef BATCHGEN_PANEL_DRIVER_H
#define BATCHGEN_PANEL_DRIVER_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../common.h"
#include "../kernels.h"

#define PANEL_NR 16   /* weight rows per panel */
#define PANEL_MR 6    /* x rows per tile at most: 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers */

/* the row of slot s within a bf16 panel's 16 values */
static const int PANEL_SLOT[PANEL_NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

static inline int64_t panel_count(int64_t N) { return (N + PANEL_NR - 1) / PANEL_NR; }
static inline int panel_row(int s, int pb) { return pb ? PANEL_SLOT[s] : s; }

/* ---- each implementation defines ------------------------------------------------------------------------ */

/* rows m0 .. m0 + R - 1 of y, columns n0 .. n0 + ncols - 1, from the panel at p, over columns [k0, k0 + kc) of x and
 * the panel: each output's chain starts from zero (first) or from y's value, where the previous block left it (R
 * a compile-time constant at every call: always_inline) */
static void panel_tile(const int R, const float *x, int32_t K, int32_t k0, int32_t kc, const void *p, int pb,
                       float *y, int64_t N, int64_t n0, int ncols, int first);

/* ---- shared ---------------------------------------------------------------------------------------------- */

#define PANEL_KC 512   /* columns per block: a panel's block (16 KB float32, 8 KB bf16) stays in L1 across tiles */
#define PANEL_MC 96    /* rows per block: their KC columns (192 KB) stay in L2 across the panels */

#define PANEL_CASE(R) case R: panel_tile(R, xm, K, k0, kc, pp, pb, ym, N, n0, ncols, k0 == 0); break;

/* Blocked like a GEMM: for each block of KC columns, each block of MC rows, each panel (the threads' split), the
 * row tiles (rows split as evenly as the tiles allow). A chain continues through y across column blocks, so the
 * blocking changes no bit. */
void panel_linear_f32(const float *x, int32_t M, int32_t K, const void *panels, int32_t pb, int64_t N, float *y,
                      int32_t nt) {
    const int64_t P = panel_count(N);
    /* a panel read by one or two tiles gains nothing from column blocks: each is read in one pass, from memory in
     * order (decode's rows; column blocks would walk the weights twice, in strides) */
    const int32_t KB = M <= 2 * PANEL_MR && K > 0 ? K : PANEL_KC;
#pragma omp parallel num_threads(nt)
    for (int32_t k0 = 0; k0 < K || k0 == 0; k0 += KB) {
        const int32_t kc = K - k0 < KB ? K - k0 : KB;
        for (int32_t mb = 0; mb < M; mb += PANEL_MC) {
            const int32_t mc = M - mb < PANEL_MC ? M - mb : PANEL_MC;
            const int tiles = (mc + PANEL_MR - 1) / PANEL_MR;
#pragma omp for schedule(static) nowait   /* a panel is the same thread's in every block */
            for (int64_t p = 0; p < P; p++) {
                const void *pp = pb ? (const void *)((const uint16_t *)panels + p * K * PANEL_NR)
                                    : (const void *)((const float *)panels + p * K * PANEL_NR);
                const int64_t n0 = p * PANEL_NR;
                const int ncols = N - n0 < PANEL_NR ? (int)(N - n0) : PANEL_NR;
                for (int t = 0, m0 = mb; t < tiles; t++) {
                    const int R = (mb + mc - m0) / (tiles - t);
                    const float *xm = x + (int64_t)m0 * K;
                    float *ym = y + (int64_t)m0 * N;
                    switch (R) { PANEL_CASE(6) PANEL_CASE(5) PANEL_CASE(4) PANEL_CASE(3) PANEL_CASE(2) PANEL_CASE(1) }
                    m0 += R;
                }
            }
        }
        if (K == 0) break;
    }
}

void panel_pack(const void *w, int32_t wb, int64_t N, int32_t K, void *panels, int32_t pb) {
    const int64_t P = panel_count(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++)
        for (int32_t k = 0; k < K; k++)
            for (int s = 0; s < PANEL_NR; s++) {
                const int64_t n = p * PANEL_NR + panel_row(s, pb), i = (p * K + k) * PANEL_NR + s;
                const float v = n >= N ? 0.0f : wb ? bf16_to_f32(((const uint16_t *)w)[n * K + k])
                                                   : ((const float *)w)[n * K + k];
                if (pb) ((uint16_t *)panels)[i] = f32_to_bf16(v);
                else ((float *)panels)[i] = v;
            }
}

void panel_unpack_f32(const void *panels, int32_t pb, int64_t N, int32_t K, float *w) {
    const int64_t P = panel_count(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++)
        for (int s = 0; s < PANEL_NR; s++) {
            const int64_t n = p * PANEL_NR + panel_row(s, pb);
            if (n >= N) continue;
            for (int32_t k = 0; k < K; k++) {
                const int64_t i = (p * K + k) * PANEL_NR + s;
                w[n * K + k] = pb ? bf16_to_f32(((const uint16_t *)panels)[i]) : ((const float *)panels)[i];
            }
        }
}

#endif
