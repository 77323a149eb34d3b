/* y[M, N] = x[M, K] @ w[N, K]^T for a few rows (M <= 16): the LM head of decode steps, which see one row per
 * running sequence. torch's matmul at such M runs far below both the memory and the compute limit on the
 * 262,144 x 640 head (docs/perf/code-notes-kernels.md). Here each weight row is read once,
 * from memory, and dotted with every x row (x stays in L1), so the head is memory-bound: about its bytes over
 * the bandwidth. bf16 (x, w, y bf16; float32 accumulation) or float32, per implementation:
 *   avx512_bf16.c: vdpbf16ps on bf16 pairs (float32: as avx512.c); avx2.c, avx512.c: widen to float32 + FMA
 *   (vec.h); portable.c: scalar.
 *
 * This header is what the implementations share. An implementation file includes it, then defines dots_head
 * (declared below). */
#ifndef BATCHGEN_SMALL_M_DRIVER_H
#define BATCHGEN_SMALL_M_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "../common.h"
#include "../kernels.h"

#define RB 8          /* x rows per pass over a weight row: 8 independent accumulation chains */

static inline float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- each implementation defines ------------------------------------------------------------------------ */

/* The dots of R x rows (starting at row m0) with weight row wr over their first c columns, c returned (0 where the
 * implementation has no vector loop), into sums[0..R); dots adds the rest. R is a compile-time constant at every
 * call (always_inline). */
static int32_t dots_head(const int R, const void *x, int64_t m0, int32_t K, const void *wr, int is_bf16,
                         float *sums);

/* dots of R x rows (starting at row m0) with weight row wr, into out[0..R) */
static inline __attribute__((always_inline)) void dots(const int R, const void *x, int64_t m0, int32_t K,
                                                       const void *wr, int is_bf16, float *out) {
    float tail[RB] = {0};
    const int32_t c = dots_head(R, x, m0, K, wr, is_bf16, tail);
    for (int r = 0; r < R; r++) {
        float s = tail[r];
        for (int32_t k = c; k < K; k++) s += load1(x, (m0 + r) * K + k, is_bf16) * load1(wr, k, is_bf16);
        out[r] = s;
    }
}

static void small_m(const void *x, int32_t M, int32_t K, const void *w, int64_t N, void *y, int is_bf16, int32_t nt) {
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t n = 0; n < N; n++) {
        const void *wr = is_bf16 ? (const void *)((const uint16_t *)w + n * K) : (const void *)((const float *)w + n * K);
        float out[RB];
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const int R = M - m0 < RB ? (int)(M - m0) : RB;
            switch (R) {          /* constant R: unrolled row loops */
            case 8: dots(8, x, m0, K, wr, is_bf16, out); break;
            case 7: dots(7, x, m0, K, wr, is_bf16, out); break;
            case 6: dots(6, x, m0, K, wr, is_bf16, out); break;
            case 5: dots(5, x, m0, K, wr, is_bf16, out); break;
            case 4: dots(4, x, m0, K, wr, is_bf16, out); break;
            case 3: dots(3, x, m0, K, wr, is_bf16, out); break;
            case 2: dots(2, x, m0, K, wr, is_bf16, out); break;
            default: dots(1, x, m0, K, wr, is_bf16, out); break;
            }
            for (int r = 0; r < R; r++) {
                if (is_bf16) ((uint16_t *)y)[(m0 + r) * N + n] = f32_to_bf16(out[r]);
                else ((float *)y)[(m0 + r) * N + n] = out[r];
            }
        }
    }
}

void small_m_linear_bf16(const uint16_t *x, int32_t M, int32_t K, const uint16_t *w, int64_t N, uint16_t *y,
                         int32_t nt) {
    small_m(x, M, K, w, N, y, 1, nt);
}
void small_m_linear_f32(const float *x, int32_t M, int32_t K, const float *w, int64_t N, float *y, int32_t nt) {
    small_m(x, M, K, w, N, y, 0, nt);
}

#endif
