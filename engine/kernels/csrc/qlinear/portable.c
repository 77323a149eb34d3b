/* The int8 linear (driver.h) in plain C loops over the packed layout: the reference the vector implementations are
 * tested against. */
#include "../dispatch.h"
#include "../kernels.h"

#if QLINEAR_ISA == ISA_PORTABLE

#define MR 4   /* rows per tile: the scalar loops keep no accumulators in registers */
#include "driver.h"

static void tile(const int R, const int WIDE, const int FUSED, const qact_t *q, int ldq, int Kp, const float *sa,
                 const float *mn, const int8_t *w, const uint16_t *sw, const int16_t *ws, const int8_t *pf,
                 float acc[MR][32]) {
    (void)WIDE;
    (void)pf;   /* the reference prefetches nothing */
    (void)FUSED;
    const int K4 = Kp / 4, G = Kp / QK;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 32; j++) {
            const int blk = j / 16, lane = j % 16;
            const int8_t *wb = w + (size_t)blk * K4 * 64 + lane * 4;
            const uint16_t *s = sw + (size_t)blk * G * 16 + lane;
            const int16_t *c = ws + (size_t)blk * G * 16 + lane;
            float y = 0.0f;
            for (int g = 0; g < G; g++) {
                int32_t dot = 0;
                for (int k = g * QK; k < (g + 1) * QK; k++)
                    dot += (int32_t)q[(size_t)r * ldq + k] * wb[(size_t)(k / 4) * 64 + k % 4];
                const float sg = f16_to_f32(s[(size_t)g * 16]);
                y = fmaf((float)dot, sg * sa[(size_t)r * G + g], y);
                y = fmaf(sg * (float)c[(size_t)g * 16], mn[(size_t)r * G + g], y);
            }
            acc[r][j] = y;
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
