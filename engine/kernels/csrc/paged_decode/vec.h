/* Paged decode attention's vector pieces, written once with the vf_* of simd/avx2.h or simd/avx512.h (8 or 16
 * lanes): float32 and bf16 caches, keys and values widened to float32 in registers. Included by avx2.c, avx512.c
 * and avx512_bf16.c after driver.h. */
#ifndef BATCHGEN_PAGED_DECODE_VEC_H
#define BATCHGEN_PAGED_DECODE_VEC_H

/* A row of keys or values as float32 vectors, from a bf16 or a float32 cache (an int8 cache is widened into a
 * float32 tile first, or takes the AVX512-BF16 paths). `kind` is a compile-time constant at every call site
 * (always_inline), so each instantiation has no branch. */
static inline __attribute__((always_inline)) vf load_kv(const void *base, int64_t i, const int kind) {
    return kind == KV_BF16 ? vf_load_bf16((const uint16_t *)base + i) : vf_load((const float *)base + i);
}

/* fast_scores' float32 loops for tokens [j, n) (j > 0 where bf16 dot products did the first j). */
static inline __attribute__((always_inline)) void vec_scores(const int G, const int kind, const float *qf,
                                                             const void *k, int64_t stride, int32_t j, int32_t n,
                                                             int32_t D, float *s, int32_t ld) {
    for (; j + 1 < n; j += 2) {                         /* two tokens at a time: 2G independent chains */
        const int64_t r0 = j * stride, r1 = r0 + stride;
        vf a[8], b[8];
        for (int g = 0; g < G; g++) a[g] = b[g] = vf_zero();
        for (int32_t c = 0; c < D; c += VEC_WIDTH) {
            const vf x0 = load_kv(k, r0 + c, kind), x1 = load_kv(k, r1 + c, kind);
            for (int g = 0; g < G; g++) {
                const vf qv = vf_load(qf + g * D + c);
                a[g] = vf_fma(qv, x0, a[g]);
                b[g] = vf_fma(qv, x1, b[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            s[g * ld + j] = vf_hsum(a[g]);
            s[g * ld + j + 1] = vf_hsum(b[g]);
        }
    }
    for (; j < n; j++) {
        vf a[8];
        for (int g = 0; g < G; g++) a[g] = vf_zero();
        for (int32_t c = 0; c < D; c += VEC_WIDTH) {
            const vf kv = load_kv(k, j * stride + c, kind);
            for (int g = 0; g < G; g++) a[g] = vf_fma(vf_load(qf + g * D + c), kv, a[g]);
        }
        for (int g = 0; g < G; g++) s[g * ld + j] = vf_hsum(a[g]);
    }
}

/* acc[g] += sum_j p[g*ld + j] * v_j: per column chunk of two vectors, the G accumulators stay in registers
 * across the block's tokens (2G independent chains). */
static inline __attribute__((always_inline)) void vec_accumulate(const int G, const int kind, float *acc,
                                                                 const float *p, int32_t ld, const void *v,
                                                                 int64_t stride, int32_t n, int32_t D) {
    for (int32_t c = 0; c < D; c += 2 * VEC_WIDTH) {
        vf a0[8], a1[8];
        for (int g = 0; g < G; g++) {
            a0[g] = vf_load(acc + g * D + c);
            a1[g] = vf_load(acc + g * D + c + VEC_WIDTH);
        }
        for (int32_t j = 0; j < n; j++) {
            const vf v0 = load_kv(v, j * stride + c, kind), v1 = load_kv(v, j * stride + c + VEC_WIDTH, kind);
            for (int g = 0; g < G; g++) {
                const vf pj = vf_set1(p[g * ld + j]);
                a0[g] = vf_fma(pj, v0, a0[g]);
                a1[g] = vf_fma(pj, v1, a1[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            vf_store(acc + g * D + c, a0[g]);
            vf_store(acc + g * D + c + VEC_WIDTH, a1[g]);
        }
    }
}

#endif
