/* float32 vectors for the AVX2 + FMA implementations (8 lanes; the AVX-512 ones include simd/avx512.h, 16 lanes).
 *
 * vf_* wrap the few intrinsics the vector code uses: zero, load (float32 or widened bf16), fused multiply-add,
 * broadcast, store and a horizontal sum. Code written with them (a family's vec.h) serves both widths. */
#ifndef BATCHGEN_SIMD_AVX2_H
#define BATCHGEN_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#define VEC_WIDTH 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }   /* a * b + c */
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
