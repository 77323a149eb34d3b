/* The few-row linear (driver.h) in scalar loops: the reference. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_PORTABLE
#include "driver.h"

/* no vector loop: tile sums every column */
static int32_t tile_head(const int R, const int C, const void *x, int64_t m0, const void *w, int64_t n0, int32_t K,
                         int32_t k0, int32_t len, int xb, int wb, float sums[TM][TN]) {
    (void)R, (void)C, (void)x, (void)m0, (void)w, (void)n0, (void)K, (void)k0, (void)len, (void)xb, (void)wb,
        (void)sums;
    return 0;
}

#endif
