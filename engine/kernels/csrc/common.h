/* Helpers shared by the kernels in this folder: bf16 <-> float32, fp16 -> float32 and a vectorizable exp. */
#ifndef BATCHGEN_COMMON_H
#define BATCHGEN_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* int8 KV cache (kv_cache_dtype: int8): values per float32 scale along a row (engine/quant/int8_kv.py) */
#define I8_GROUP 32

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {       /* round to nearest even, as torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half -> float32, exact for every finite half (normal or subnormal), vectorizable: the exponent and
 * mantissa bits shifted into place are a float 2^-112 times the value, so one multiply by 2^112 finishes it (a
 * subnormal half becomes a normal float on the way). Inf and NaN become huge finite values: the int8 weights'
 * scales (engine/quant/int8.py) are finite by construction. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t bits = ((uint32_t)h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    f *= 0x1p112f;
    return (h & 0x8000u) ? -f : f;
}

/* exp(x), vectorizable: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial; relative error ~2e-7, below
 * float32 rounding of what it feeds. x is clamped to [-87, 88] (results ~1e-38 .. ~1.6e38): softmax over
 * x - max <= 0 and sigmoid need nothing wider. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;   /* ln2 split hi + lo */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The gated-MLP activations (elementwise.c's GLU kernels and qlinear/'s fused gate_up + GLU use these, so both
 * give the same bits). gelu_tanh(g) = g * 0.5 * (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3) */
static inline float gelu_tanh(float g) {
    const float z2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp_clamped(-z2));
}

static inline float silu(float g) { return g / (1.0f + exp_clamped(-g)); }

#endif
