/* float32 vectors for the AVX-512 implementations (16 lanes; the AVX2 ones include simd/avx2.h, 8 lanes).
 *
 * vf_* wrap the few intrinsics the vector code uses: zero, load (float32 or widened bf16), fused multiply-add,
 * broadcast, store and a horizontal sum. Code written with them (a family's vec.h) serves both widths. */
#ifndef BATCHGEN_SIMD_AVX512_H
#define BATCHGEN_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define VEC_WIDTH 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c */
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }

/* e^x on 16 lanes for x in [-87, 9]: 2^(x log2 e) as a degree-5 polynomial in the fraction (relative error
 * ~3e-6, under the bf16 rounding of the probabilities it feeds: AMX attention, prefill and decode) scaled by 2^n
 * (vscalefps); x below -87 gives e^-87. */
#define LOG2E_F 1.44269504088896341f    /* log2(e): e^x = 2^(x log2 e) */
static inline __m512 exp16_fast(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E_F));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^t on 16 lanes for t up to ~127: t = floor(t) + f with f in [0, 1) (vreducepsv: t less its floor, exact),
 * 2^f by a degree-5 minimax fit on [0, 1) (relative error 1.6e-7: 20x under exp16_fast's), scaled by 2^floor(t)
 * in vscalefps, which floors t itself. Seven operations against exp16_fast's ten; t = -inf gives NaN (callers mask
 * such lanes), t below -149 gives 0. */
static inline __m512 exp2_16(__m512 t) {
#ifdef __AVX512DQ__
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
    const __m512 f = _mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
    __m512 p = _mm512_set1_ps(1.8755869e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.98745e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.583507e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4014717e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931546e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999998e-1f));
    return _mm512_scalef_ps(p, t);
}

/* e^(s - m) on 16 lanes given m log2 e (once per row or block): 2^(s log2 e - m log2 e), the subtraction folded
 * into one FMA (its rounding moves the exponent by at most |m log2 e| x 2^-24) */
static inline __m512 exp_less16(__m512 s, __m512 m_log2e) {
    return exp2_16(_mm512_fmsub_ps(s, _mm512_set1_ps(LOG2E_F), m_log2e));
}

#endif
