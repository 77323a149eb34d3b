/* The few-row linear (driver.h) on AVX2 + FMA: vec.h's tiles at 8 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_AVX2
#include "../simd/avx2.h"

#include "driver.h"
#include "vec.h"

static inline __attribute__((always_inline)) int32_t tile_head(const int R, const int C, const void *x, int64_t m0,
                                                               const void *w, int64_t n0, int32_t K, int32_t k0,
                                                               int32_t len, int xb, int wb, float sums[TM][TN]) {
    return tile_vec(R, C, x, m0, w, n0, K, k0, len, xb, wb, sums);
}

#endif
