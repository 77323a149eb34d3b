/* The few-row linear (driver.h) in scalar loops: the reference. */
#include "../dispatch.h"
#include "../kernels.h"

#if SMALL_M_ISA == ISA_PORTABLE
#include "driver.h"

/* no vector loop: dots sums every column */
static int32_t dots_head(const int R, const void *x, int64_t m0, int32_t K, const void *wr, int is_bf16,
                         float *sums) {
    (void)R;
    (void)x;
    (void)m0;
    (void)K;
    (void)wr;
    (void)is_bf16;
    (void)sums;
    return 0;
}

#endif
