/* The panel linear (driver.h) in scalar loops: the reference, the same bits as the vector code (fmaf). */
#include "../dispatch.h"
#include "../kernels.h"

#if PANEL_ISA == ISA_PORTABLE
#include "driver.h"

static void panel_tile(const int R, const float *x, int32_t K, int32_t k0, int32_t kc, const void *p, int pb,
                       float *y, int64_t N, int64_t n0, int ncols, int first) {
    for (int r = 0; r < R; r++)
        for (int s = 0; s < PANEL_NR; s++) {
            const int row = panel_row(s, pb);
            if (row >= ncols) continue;
            float acc = first ? 0.0f : y[(int64_t)r * N + n0 + row];
            for (int32_t k = k0; k < k0 + kc; k++) {
                const int64_t i = (int64_t)k * PANEL_NR + s;
                const float w = pb ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
                acc = fmaf(x[(int64_t)r * K + k], w, acc);
            }
            y[(int64_t)r * N + n0 + row] = acc;
        }
}

#endif
