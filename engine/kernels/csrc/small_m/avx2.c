/* The few-row linear (driver.h) on AVX2 + FMA: vec.h's dots at 8 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_AVX2
#include "../simd/avx2.h"

#include "driver.h"
#include "vec.h"

static inline __attribute__((always_inline)) int32_t dots_head(const int R, const void *x, int64_t m0, int32_t K,
                                                               const void *wr, int is_bf16, float *sums) {
    return dots_vec(R, x, m0, K, wr, is_bf16, sums);
}

#endif
