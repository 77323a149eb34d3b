/* Fused elementwise kernels for the CPU, in bf16 (_bf16) and float32 (_f32): one pass over memory where torch
 * makes three to five (each torch op reads and writes the whole activation; in bf16 with a float32 round trip).
 *
 *   gelu_tanh_mul_*  out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i]     (GeGLU on the fused gate_up output)
 *   silu_mul_*       out[t, i] = silu(x[t, i]) * x[t, I + i]          (SwiGLU)
 *   rms_norm_rope_*  out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, optionally then RoPE (strided rows)
 *   rope_neox_*      x[t, h] = x * cos + rotate_half(x) * sin, in place (strided rows)
 *   add_rms_norm_*   xo = x + rms_norm(h) (or x + h), then out = rms_norm(xo): a residual add with the norms on
 *                    either side of it (Gemma's sandwich norms, Llama's post-attention norm) in one pass
 *
 * All math is float32; a bf16 output is rounded once (torch rounds after every op, so results differ from
 * torch by at most an ulp or two of bf16; in float32 by float rounding and exp's ~2e-7). Plain C written for
 * the compiler's vectorizer (omp simd): the instruction set is the build's (-march=native: AVX-512 or
 * AVX2 + FMA; without it, baseline SSE2). Rows are split across OpenMP threads once a call touches
 * PAR_MIN_ELEMENTS or more; a smaller one (a decode step's few rows) runs on the calling thread, where waking the
 * sleeping second thread (batchgen's short barrier spin, engine/omp_wait.py) costs more than the work. A row's
 * arithmetic is the same on any thread, so the split never changes a bit.
 */
#include "common.h"
#include "kernels.h"

#define PAR_MIN_ELEMENTS 32768

/* Element access for the two activation dtypes: bf16 (uint16_t, rounded to nearest even on store) and float32.
 * Each kernel below is stamped out once per dtype; the math is the same float32 code. */
static inline float ld_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void st_bf16(uint16_t *p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
static inline float rt_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }   /* round trip through bf16 */
static inline float ld_f32(const float *p, int64_t i) { return p[i]; }
static inline void st_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline float rt_f32(float x) { return x; }

/* 1 / sqrt(mean(r^2) + eps) of one row: the one sum-of-squares loop every norm below uses, so the fused add_rms_norm_*
 * and rms_norm_rope_* give the same bits for the same row. */
#define INV_RMS(T, SFX)                                                                                    \
    static inline float inv_rms_##SFX(const T *r, int64_t dim, float eps) {                               \
        float ss = 0.0f;                                                                                   \
        _Pragma("omp simd reduction(+:ss)")                                                                \
        for (int64_t i = 0; i < dim; i++) ss += ld_##SFX(r, i) * ld_##SFX(r, i);                           \
        return 1.0f / sqrtf(ss / (float)dim + eps);                                                        \
    }

INV_RMS(uint16_t, bf16)
INV_RMS(float, f32)

#define GLU(NAME, T, SFX, ACT)                                                                             \
    void NAME(const T *x, int64_t rows, int64_t inter, T *out, int32_t num_threads) {                     \
        (void)num_threads;                                                                                 \
        const int par = rows * inter >= PAR_MIN_ELEMENTS; (void)par;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (par)")                     \
        for (int64_t t = 0; t < rows; t++) {                                                               \
            const T *g = x + t * 2 * inter, *u = g + inter;                                                \
            T *o = out + t * inter;                                                                        \
            _Pragma("omp simd")                                                                            \
            for (int64_t i = 0; i < inter; i++) st_##SFX(o, i, ACT(ld_##SFX(g, i)) * ld_##SFX(u, i));     \
        }                                                                                                  \
    }

GLU(gelu_tanh_mul_bf16, uint16_t, bf16, gelu_tanh)
GLU(silu_mul_bf16, uint16_t, bf16, silu)
GLU(gelu_tanh_mul_f32, float, f32, gelu_tanh)
GLU(silu_mul_f32, float, f32, silu)

/* x: `tokens` x `heads` rows of `dim`, row (t, h) at x + t * stride + h * dim; out is dense
 * [tokens, heads, dim]; w already holds (offset + w) in float32. With cos/sin ([tokens, dim], or NULL)
 * the normalized row is then rotated (neox RoPE): Gemma's q/k norm and RoPE in one pass. */
#define RMS_NORM_ROPE(NAME, T, SFX)                                                                        \
    void NAME(const T *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const float *w,      \
              float eps, const T *cos, const T *sin, T *out, int32_t num_threads) {                        \
        (void)num_threads;                                                                                 \
        const int64_t half = dim / 2;                                                                      \
        const int par = tokens * heads * dim >= PAR_MIN_ELEMENTS; (void)par;                               \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (par)")                     \
        for (int64_t t = 0; t < tokens; t++) {                                                             \
            float y[dim];                                                                                  \
            for (int64_t h = 0; h < heads; h++) {                                                          \
                const T *xr = x + t * stride + h * dim;                                                    \
                T *o = out + (t * heads + h) * dim;                                                        \
                const float inv = inv_rms_##SFX(xr, dim, eps);                                             \
                if (!cos) {                                                                                \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t i = 0; i < dim; i++) st_##SFX(o, i, ld_##SFX(xr, i) * inv * w[i]);        \
                    continue;                                                                              \
                }                                                                                          \
                /* HF rounds the normalized row to the activation dtype before RoPE: so do we. */          \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = 0; i < dim; i++) y[i] = rt_##SFX(ld_##SFX(xr, i) * inv * w[i]);           \
                const T *c = cos + t * dim, *s = sin + t * dim;                                            \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = 0; i < half; i++) {                                                       \
                    st_##SFX(o, i, y[i] * ld_##SFX(c, i) - y[i + half] * ld_##SFX(s, i));                  \
                    st_##SFX(o, i + half, y[i + half] * ld_##SFX(c, i + half) + y[i] * ld_##SFX(s, i + half)); \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

RMS_NORM_ROPE(rms_norm_rope_bf16, uint16_t, bf16)
RMS_NORM_ROPE(rms_norm_rope_f32, float, f32)

/* x, h, xo, out: dense [tokens, dim]. xo = x + (wh ? rms_norm(h) * wh : h), with the normalized h rounded to the
 * activation dtype before the add and the sum rounded once (what torch's norm-then-add computes); then, with wo,
 * out = rms_norm(xo) * wo from the rounded xo. wh/wo hold (offset + w) in float32, as rms_norm_rope_*'s w. Both
 * norms use rms_norm_rope_*'s inv_rms, so each output equals the unfused kernels' bit for bit. */
#define ADD_RMS_NORM(NAME, T, SFX)                                                                         \
    void NAME(const T *x, const T *h, int64_t tokens, int64_t dim, const float *wh, float eps_h,          \
              const float *wo, float eps_o, T *xo, T *out, int32_t num_threads) {                          \
        (void)num_threads;                                                                                 \
        const int par = tokens * dim >= PAR_MIN_ELEMENTS; (void)par;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (par)")                     \
        for (int64_t t = 0; t < tokens; t++) {                                                             \
            const T *xr = x + t * dim, *hr = h + t * dim;                                                  \
            T *xn = xo + t * dim;                                                                          \
            if (wh) {                                                                                      \
                const float inv = inv_rms_##SFX(hr, dim, eps_h);                                           \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = 0; i < dim; i++)                                                          \
                    st_##SFX(xn, i, ld_##SFX(xr, i) + rt_##SFX(ld_##SFX(hr, i) * inv * wh[i]));            \
            } else {                                                                                       \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = 0; i < dim; i++) st_##SFX(xn, i, ld_##SFX(xr, i) + ld_##SFX(hr, i));      \
            }                                                                                              \
            if (!wo) continue;                                                                             \
            T *o = out + t * dim;                                                                          \
            const float inv = inv_rms_##SFX(xn, dim, eps_o);                                               \
            _Pragma("omp simd")                                                                            \
            for (int64_t i = 0; i < dim; i++) st_##SFX(o, i, ld_##SFX(xn, i) * inv * wo[i]);               \
        }                                                                                                  \
    }

ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16)
ADD_RMS_NORM(add_rms_norm_f32, float, f32)

/* x: tokens of `heads` rows of `dim`, token t's head h at x + t * stride + h * dim; cos/sin: [tokens, dim]
 * dense (the model's cos/sin, cast like HF's). Rotate-half (neox) form, in place. */
#define ROPE_NEOX(NAME, T, SFX)                                                                            \
    void NAME(T *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const T *cos, const T *sin, \
              int32_t num_threads) {                                                                       \
        (void)num_threads;                                                                                 \
        const int64_t half = dim / 2;                                                                      \
        const int par = tokens * heads * dim >= PAR_MIN_ELEMENTS; (void)par;                               \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (par)")                     \
        for (int64_t t = 0; t < tokens; t++) {                                                             \
            const T *c = cos + t * dim, *s = sin + t * dim;                                                \
            for (int64_t h = 0; h < heads; h++) {                                                          \
                T *xh = x + t * stride + h * dim;                                                          \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = 0; i < half; i++) {                                                       \
                    const float a = ld_##SFX(xh, i), b = ld_##SFX(xh, i + half);                           \
                    st_##SFX(xh, i, a * ld_##SFX(c, i) - b * ld_##SFX(s, i));                              \
                    st_##SFX(xh, i + half, b * ld_##SFX(c, i + half) + a * ld_##SFX(s, i + half));         \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

ROPE_NEOX(rope_neox_bf16, uint16_t, bf16)
ROPE_NEOX(rope_neox_f32, float, f32)
