/* small_m's dots with float32 vectors, written once with the vf_* of simd/avx2.h or simd/avx512.h: bf16 widened to
 * float32, then FMA. Included by avx2.c, avx512.c and avx512_bf16.c after driver.h. */
#ifndef BATCHGEN_SMALL_M_VEC_H
#define BATCHGEN_SMALL_M_VEC_H

/* dots_head with float32 vectors: the first c = K rounded down to the vector width columns */
static inline __attribute__((always_inline)) int32_t dots_vec(const int R, const void *x, int64_t m0, int32_t K,
                                                              const void *wr, int is_bf16, float *sums) {
    int32_t c = 0;
    vf acc[RB];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    for (; c + VEC_WIDTH <= K; c += VEC_WIDTH) {
        const vf wv = is_bf16 ? vf_load_bf16((const uint16_t *)wr + c) : vf_load((const float *)wr + c);
        for (int r = 0; r < R; r++) {
            const int64_t i = (m0 + r) * K + c;
            const vf xv = is_bf16 ? vf_load_bf16((const uint16_t *)x + i) : vf_load((const float *)x + i);
            acc[r] = vf_fma(xv, wv, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = vf_hsum(acc[r]);
    return c;
}

#endif
