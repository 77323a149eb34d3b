/* One float32 vector type for the kernels, chosen at compile time from the target's instruction set:
 *
 *   build flags (examples)            VEC_WIDTH  KERNEL_ISA
 *   -march=native on AVX-512 CPUs     16         "avx512" ("avx512_bf16" with __AVX512BF16__)
 *   -march=native on AVX2 + FMA CPUs   8         "avx2"   (also forced with -mavx2 -mfma, for tests)
 *   anything else (-O3 alone, arm64)   0         "portable": the plain C loops, which are the reference
 *
 * vf_* wrap the few intrinsics the fast paths use: zero, load (float32 or widened bf16), fused multiply-add,
 * broadcast, store and a horizontal sum. Code that uses them is written once for every width.
 */
#ifndef BATCHGEN_SIMD_H
#define BATCHGEN_SIMD_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
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
#if defined(__AVX512BF16__)
#define KERNEL_ISA "avx512_bf16"
#else
#define KERNEL_ISA "avx512"
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC_WIDTH 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define KERNEL_ISA "avx2"

#else
#define VEC_WIDTH 0
#define KERNEL_ISA "portable"
#endif

/* The ISA this library was built for ("avx512_bf16", "avx512", "avx2" or "portable"). */
const char *batchgen_kernel_isa(void);

#endif
