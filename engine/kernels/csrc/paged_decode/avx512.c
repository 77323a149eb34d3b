/* Paged decode attention (driver.h) on AVX-512 without BF16 dot products: vec.h's pieces at 16 lanes, for bf16 and
 * float32 caches; an int8 cache is widened into a float32 tile first. */
#include "../dispatch.h"
#include "../kernels.h"

#if PAGED_DECODE_ISA == ISA_AVX512
#include "../simd/avx512.h"

#define FAST_PATH 1
#define PAIRED_PV 0
#define I8_IN_DOT 0
#include "driver.h"
#include "vec.h"

static inline __attribute__((always_inline)) void fast_scores(
        const int G, const int kind, const float *qf, const uint16_t *qb, const void *k, int64_t stride,
        int32_t n, int32_t D, float *s, int32_t ld, const float *sc, int64_t sc_stride) {
    (void)qb;
    (void)sc;
    (void)sc_stride;
    vec_scores(G, kind, qf, k, stride, 0, n, D, s, ld);
}

static inline __attribute__((always_inline)) void fast_accumulate(
        const int G, const int kind, float *acc, const float *p, int32_t ld, const void *v, int64_t stride,
        int32_t n, int32_t D, const float *sc, int64_t sc_stride) {
    (void)sc;
    (void)sc_stride;
    vec_accumulate(G, kind, acc, p, ld, v, stride, n, D);
}

#endif
