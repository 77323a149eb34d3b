/* Writing a step's keys and values into the paged KV cache: kv_write_{f32,bf16}_{f32,bf16,i8} (source dtype, then
 * cache dtype). Row t of k and v (num_kv_heads * head_dim contiguous elements; token strides ks, vs) goes to
 * slot slots[t] of the caches ([num_slots, row] dense), converted on the way (float32 -> bf16 rounds to
 * nearest even, as torch's .to(torch.bfloat16)). One pass where torch made a converted copy and two
 * index_copy_ calls, whose cost for a decode step's rows was mostly call overhead. */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

static inline void put_row(const void *src, int src_bf16, void *dst, int dst_bf16, int64_t n) {
    if (src_bf16 == dst_bf16) {
        memcpy(dst, src, (size_t)n * (src_bf16 ? 2 : 4));
    } else if (src_bf16) {                                   /* bf16 -> float32: exact */
        const uint16_t *s = (const uint16_t *)src;
        float *d = (float *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = bf16_to_f32(s[i]);
    } else {                                                 /* float32 -> bf16: round to nearest even */
        const float *s = (const float *)src;
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(s[i]);
    }
}

/* Returns 1 (writing nothing) when a slot is outside [0, num_slots): torch's index_copy_ raised there. */
static int kv_write(const void *k, const void *v, int src_bf16, int64_t tokens, int64_t row, int64_t ks, int64_t vs,
                    const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int dst_bf16,
                    int32_t num_threads) {
    const size_t ssize = src_bf16 ? 2 : 4, dsize = dst_bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * row >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        const size_t d = (size_t)slots[t] * (size_t)row * dsize;
        put_row((const char *)k + (size_t)(t * ks) * ssize, src_bf16, (char *)k_cache + d, dst_bf16, row);
        put_row((const char *)v + (size_t)(t * vs) * ssize, src_bf16, (char *)v_cache + d, dst_bf16, row);
    }
    return 0;
}

#define KV_WRITE(NAME, SRC_BF16, DST_BF16)                                                                    \
    int NAME(const void *k, const void *v, int64_t tokens, int64_t row, int64_t ks, int64_t vs,               \
             const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int32_t num_threads) {    \
        return kv_write(k, v, SRC_BF16, tokens, row, ks, vs, slots, num_slots, k_cache, v_cache, DST_BF16,    \
                        num_threads);                                                                         \
    }

KV_WRITE(kv_write_f32_f32, 0, 0)
KV_WRITE(kv_write_f32_bf16, 0, 1)
KV_WRITE(kv_write_bf16_f32, 1, 0)
KV_WRITE(kv_write_bf16_bf16, 1, 1)

/* ---- an int8 cache (kv_cache_dtype: int8) -------------------------------------------------------------------
 * Each (token, KV head) row of D values (D a multiple of 32) is stored as D int8 quants and one float32 scale per
 * group of 32, symmetric: scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in [-127, 127] (0 for an
 * all-zero group). A block holds its bs x Hkv rows of D bytes, then their bs x Hkv x D/32 scales
 * (engine/quant/int8_kv.py, whose torch reference gives the same bytes). */
static inline void quant_row(const void *src, int src_bf16, int64_t n, int8_t *dst, float *scale) {
    float amax = 0.0f;
#pragma omp simd reduction(max:amax)
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(src_bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float x = rintf((src_bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i]) * inv);
        x = x > 127.0f ? 127.0f : (x < -127.0f ? -127.0f : x);
        dst[i] = (int8_t)(x == x ? x : 0.0f);
    }
    *scale = amax / 127.0f;
}

static int kv_write_i8(const void *k, const void *v, int src_bf16, int64_t tokens, int64_t hkv, int64_t D,
                       int64_t ks, int64_t vs, const int64_t *slots, int64_t num_slots, int64_t bs, int8_t *k_cache,
                       int8_t *v_cache, int32_t num_threads) {
    if (D % I8_GROUP) return 2;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const size_t ssize = src_bf16 ? 2 : 4;
    const int64_t ng = D / I8_GROUP, rows_bytes = bs * hkv * D, block_bytes = rows_bytes + 4 * bs * hkv * ng;
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * hkv * D >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t blk = slots[t] / bs, slot = slots[t] % bs;
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t g = 0; g < ng; g++) {
                const int64_t e = h * D + g * I8_GROUP;                      /* element of the token's row */
                const int64_t row = blk * block_bytes + slot * hkv * D + e;
                const int64_t sc = blk * block_bytes + rows_bytes + 4 * ((slot * hkv + h) * ng + g);
                float s;
                quant_row((const char *)k + (size_t)(t * ks + e) * ssize, src_bf16, I8_GROUP, k_cache + row, &s);
                memcpy(k_cache + sc, &s, sizeof s);
                quant_row((const char *)v + (size_t)(t * vs + e) * ssize, src_bf16, I8_GROUP, v_cache + row, &s);
                memcpy(v_cache + sc, &s, sizeof s);
            }
    }
    return 0;
}

/* k, v: row t's heads dense (D apart), token strides ks, vs (elements); slots index [0, num_slots) */
int kv_write_f32_i8(const void *k, const void *v, int64_t tokens, int64_t hkv, int64_t D, int64_t ks, int64_t vs,
                    const int64_t *slots, int64_t num_slots, int64_t bs, int8_t *k_cache, int8_t *v_cache,
                    int32_t num_threads) {
    return kv_write_i8(k, v, 0, tokens, hkv, D, ks, vs, slots, num_slots, bs, k_cache, v_cache, num_threads);
}
int kv_write_bf16_i8(const void *k, const void *v, int64_t tokens, int64_t hkv, int64_t D, int64_t ks, int64_t vs,
                     const int64_t *slots, int64_t num_slots, int64_t bs, int8_t *k_cache, int8_t *v_cache,
                     int32_t num_threads) {
    return kv_write_i8(k, v, 1, tokens, hkv, D, ks, vs, slots, num_slots, bs, k_cache, v_cache, num_threads);
}
