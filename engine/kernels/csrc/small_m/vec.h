/* small_m's tiles with float32 vectors, written once with the vf_* of simd/avx2.h or simd/avx512.h: bf16 widened to
 * float32, then FMA. Included by avx2.c, avx512.c and avx512_bf16.c after driver.h. */
#ifndef BATCHGEN_SMALL_M_VEC_H
#define BATCHGEN_SMALL_M_VEC_H

/* tile_head with float32 vectors: the block's first c = len rounded down to the vector width columns, one vector
 * accumulator per dot, summed across its lanes at the end */
static inline __attribute__((always_inline)) int32_t tile_vec(const int R, const int C, const void *x, int64_t m0,
                                                              const void *w, int64_t n0, int32_t K, int32_t k0,
                                                              int32_t len, int xb, int wb, float sums[TM][TN]) {
    int32_t c = 0;
    vf acc[TM][TN];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = vf_zero();
    for (; c + VEC_WIDTH <= len; c += VEC_WIDTH) {
        vf wv[TN];
        for (int j = 0; j < C; j++) {
            const int64_t i = (n0 + j) * K + k0 + c;
            wv[j] = wb ? vf_load_bf16((const uint16_t *)w + i) : vf_load((const float *)w + i);
        }
        for (int r = 0; r < R; r++) {
            const int64_t i = (m0 + r) * K + k0 + c;
            const vf xv = xb ? vf_load_bf16((const uint16_t *)x + i) : vf_load((const float *)x + i);
            for (int j = 0; j < C; j++) acc[r][j] = vf_fma(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) sums[r][j] = vf_hsum(acc[r][j]);
    return c;
}

#endif
