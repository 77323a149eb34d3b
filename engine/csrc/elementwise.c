/* Fused bf16 elementwise kernels for the CPU: one pass over memory where torch makes three to five
 * (each torch op reads and writes the whole activation, in bf16 with a float32 round trip).
 *
 *   gelu_tanh_mul_bf16  out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i]     (GeGLU on the fused gate_up output)
 *   silu_mul_bf16       out[t, i] = silu(x[t, i]) * x[t, I + i]          (SwiGLU)
 *   rms_norm_rope_bf16  out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, optionally then RoPE (strided rows)
 *   rope_neox_bf16      x[t, h] = x * cos + rotate_half(x) * sin, in place (strided rows)
 *
 * All math is float32 and each output is rounded to bf16 once (torch rounds after every op, so results
 * differ from torch by at most an ulp or two of bf16; float32 models never come here). Plain C that compilers
 * vectorize; rows are split across OpenMP threads.
 */
#include "common.h"

/* gelu_tanh(g) = g * 0.5 * (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3) */
static inline float gelu_tanh(float g) {
    const float z2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp_clamped(-z2));
}

static inline float silu(float g) { return g / (1.0f + exp_clamped(-g)); }

#define GLU(NAME, ACT)                                                                                     \
    void NAME(const uint16_t *x, int64_t rows, int64_t inter, uint16_t *out, int32_t num_threads) {     \
        (void)num_threads;                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                            \
        for (int64_t t = 0; t < rows; t++) {                                                               \
            const uint16_t *g = x + t * 2 * inter, *u = g + inter;                                         \
            uint16_t *o = out + t * inter;                                                                 \
            _Pragma("omp simd")                                                                            \
            for (int64_t i = 0; i < inter; i++) o[i] = f32_to_bf16(ACT(bf16_to_f32(g[i])) * bf16_to_f32(u[i]));                \
        }                                                                                                  \
    }

GLU(gelu_tanh_mul_bf16, gelu_tanh)
GLU(silu_mul_bf16, silu)

/* x: `tokens` x `heads` rows of `dim`, row (t, h) at x + t * stride + h * dim; out is dense
 * [tokens, heads, dim]; w already holds (offset + w) in float32. With cos/sin ([tokens, dim] bf16, or NULL)
 * the normalized row is then rotated (neox RoPE): Gemma's q/k norm and RoPE in one pass. */
void rms_norm_rope_bf16(const uint16_t *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride,
                        const float *w, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                        int32_t num_threads) {
    (void)num_threads;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        float y[dim];
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + t * stride + h * dim;
            uint16_t *o = out + (t * heads + h) * dim;
            float ss = 0.0f;
#pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < dim; i++) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
            if (!cos) {
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) o[i] = f32_to_bf16(bf16_to_f32(xr[i]) * inv * w[i]);
                continue;
            }
            /* HF rounds the normalized row to bf16 before RoPE: do the same, then rotate in float32. */
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) y[i] = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv * w[i]));
            const uint16_t *c = cos + t * dim, *s = sin + t * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o[i] = f32_to_bf16(y[i] * bf16_to_f32(c[i]) - y[i + half] * bf16_to_f32(s[i]));
                o[i + half] = f32_to_bf16(y[i + half] * bf16_to_f32(c[i + half]) + y[i] * bf16_to_f32(s[i + half]));
            }
        }
    }
}

/* x: tokens of `heads` rows of `dim`, token t's head h at x + t * stride + h * dim; cos/sin: [tokens, dim]
 * dense bf16 (the model's cos/sin, cast like HF's). Rotate-half (neox) form, in place. */
void rope_neox_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride,
                    const uint16_t *cos, const uint16_t *sin, int32_t num_threads) {
    (void)num_threads;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *xh = x + t * stride + h * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(xh[i]), b = bf16_to_f32(xh[i + half]);
                xh[i] = f32_to_bf16(a * bf16_to_f32(c[i]) - b * bf16_to_f32(s[i]));
                xh[i + half] = f32_to_bf16(b * bf16_to_f32(c[i + half]) + a * bf16_to_f32(s[i + half]));
            }
        }
    }
}
