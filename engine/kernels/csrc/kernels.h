/* Every function the Python side calls (engine/kernels/binding.py reads its ctypes signatures from this file).
 *
 * Each .c file includes this header, so the compiler checks every definition against its declaration here (a
 * family in a folder defines its functions in the one implementation file dispatch.h picks for the build); the
 * binding parses the declarations below, so Python's argtypes/restype are these (tests/test_kernel_header.py).
 * Keep to the restricted syntax the parser reads: one declaration per statement, `RET NAME(TYPE ARG, ...);`, types
 * built from void/char/int/float/int32_t/int64_t/uint8_t/int8_t/uint16_t/uint32_t, `const` and `*`, no macros.
 * Names ending in _bf16 take and return bf16 as uint16_t (raw bits).
 */
#ifndef BATCHGEN_KERNELS_H
#define BATCHGEN_KERNELS_H

#include <stdint.h>

/* ---- build info ---- */
const char *batchgen_build_id(void);         /* the build's cache key (build.py: -DBATCHGEN_BUILD_ID) */
const char *batchgen_kernel_isa(void);       /* avx512_bf16 | avx512 | avx2 | portable (dispatch.h) */
const char *batchgen_q8_isa(void);           /* avx512_vnni | avx2 | portable (dispatch.h) */
int bf16_gemm_fast(void);                    /* 1: bf16_gemm uses AVX512-BF16 dot products */
int bf16_gemm_amx(int enable);                /* bf16_gemm (and prefill attention) on AMX tiles: set, returns whether on */
int prefill_online_softmax(int head_dim);      /* 1: prefill_bf16kv_* run the AMX online-softmax item (bf16_gemm/amx_flash.h) */
int prefill_f32_cols(void);                  /* prefill_f32's column tile: D a multiple of it */

/* ---- paged decode attention (paged_decode/): 0 on success, 1 for an unsupported shape ---- */
int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, int32_t num_seqs, int32_t num_heads,
                      int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t window, float scale,
                      uint16_t *out, int32_t num_threads);
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, int32_t num_seqs, int32_t num_heads,
                     int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t window, float scale,
                     float *out, int32_t num_threads);
int paged_decode_bf16kv_f32(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                            int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                            int32_t block_size, int32_t window, float scale, float *out, int32_t num_threads);
int paged_decode_i8kv_f32(const float *q, const int8_t *k_cache, const int8_t *v_cache, const int32_t *block_tables,
                          int64_t table_stride, const int32_t *seq_lens, int32_t num_seqs, int32_t num_heads,
                          int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t window, float scale,
                          float *out, int32_t num_threads);
int paged_decode_i8kv_bf16(const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                           int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                           int32_t block_size, int32_t window, float scale, uint16_t *out, int32_t num_threads);

/* ---- prefill tile softmax (masked_softmax.c), in place on scores [outer, t, g, S] ---- */
void masked_softmax_bf16(uint16_t *scores, int64_t outer, int64_t t, int64_t g, int64_t S, int64_t q_start,
                         int64_t k_start, int64_t window, int32_t num_threads);
void masked_softmax_f32(float *scores, int64_t outer, int64_t t, int64_t g, int64_t S, int64_t q_start,
                        int64_t k_start, int64_t window, int32_t num_threads);

/* ---- prefill attention (prefill/) ---- */
void prefill_bf16kv_f32(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq,
                        int Hkv, int D, int S, int64_t q_start, int64_t k_start, int64_t window, float *out, int nt);
void prefill_bf16kv_bf16(const uint16_t *q, const uint32_t *kp, int64_t ldk, const uint32_t *vp, int n, int Hq,
                         int Hkv, int D, int S, int64_t q_start, int64_t k_start, int64_t window, uint16_t *out,
                         int nt);
void prefill_f32(const float *q, const float *kt, int64_t ldk, const float *v, int n, int Hq, int Hkv, int D, int S,
                 int64_t q_start, int64_t k_start, int64_t window, float *out, int nt);
void pack_kv_bf16(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int bs, int Hkv, int D,
                  int64_t lo, int64_t hi, uint32_t *kp, uint32_t *vp, int nt);
void pack_kv_i8(const int8_t *k_cache, const int8_t *v_cache, const int32_t *table, int bs, int Hkv, int D,
                int64_t lo, int64_t hi, uint32_t *kp, uint32_t *vp, int nt);

/* ---- fused elementwise passes (elementwise.c) ---- */
void gelu_tanh_mul_bf16(const uint16_t *x, int64_t rows, int64_t inter, uint16_t *out, int32_t num_threads);
void silu_mul_bf16(const uint16_t *x, int64_t rows, int64_t inter, uint16_t *out, int32_t num_threads);
void gelu_tanh_mul_f32(const float *x, int64_t rows, int64_t inter, float *out, int32_t num_threads);
void silu_mul_f32(const float *x, int64_t rows, int64_t inter, float *out, int32_t num_threads);
void rms_norm_rope_bf16(const uint16_t *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride,
                        const float *w, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                        int32_t num_threads);
void rms_norm_rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const float *w,
                       float eps, const float *cos, const float *sin, float *out, int32_t num_threads);
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *h, int64_t tokens, int64_t dim, const float *wh,
                       float eps_h, const float *wo, float eps_o, uint16_t *xo, uint16_t *out, int32_t num_threads);
void add_rms_norm_f32(const float *x, const float *h, int64_t tokens, int64_t dim, const float *wh, float eps_h,
                      const float *wo, float eps_o, float *xo, float *out, int32_t num_threads);
void rope_neox_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const uint16_t *cos,
                    const uint16_t *sin, int32_t num_threads);
void rope_neox_f32(float *x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const float *cos,
                   const float *sin, int32_t num_threads);

/* ---- KV cache writes (kv_write.c): 0 on success, 1 for a slot outside the cache, 2 (int8) bad head_dim ---- */
int kv_write_f32_f32(const void *k, const void *v, int64_t tokens, int64_t row, int64_t ks, int64_t vs,
                     const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int32_t num_threads);
int kv_write_f32_bf16(const void *k, const void *v, int64_t tokens, int64_t row, int64_t ks, int64_t vs,
                      const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int32_t num_threads);
int kv_write_bf16_f32(const void *k, const void *v, int64_t tokens, int64_t row, int64_t ks, int64_t vs,
                      const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int32_t num_threads);
int kv_write_bf16_bf16(const void *k, const void *v, int64_t tokens, int64_t row, int64_t ks, int64_t vs,
                       const int64_t *slots, int64_t num_slots, void *k_cache, void *v_cache, int32_t num_threads);
int kv_write_f32_i8(const void *k, const void *v, int64_t tokens, int64_t hkv, int64_t D, int64_t ks, int64_t vs,
                    const int64_t *slots, int64_t num_slots, int64_t bs, int8_t *k_cache, int8_t *v_cache,
                    int32_t num_threads);
int kv_write_bf16_i8(const void *k, const void *v, int64_t tokens, int64_t hkv, int64_t D, int64_t ks, int64_t vs,
                     const int64_t *slots, int64_t num_slots, int64_t bs, int8_t *k_cache, int8_t *v_cache,
                     int32_t num_threads);

/* ---- int8 linear (qlinear/, q8_embed.c); weights int8 with an fp16 scale (sw) and the int16 sum of quants (ws) per
 * group of 32; activations quantized to uint8 per token and group of 32 ---- */
void q8_quant_act_f32(const float *x, int M, int K, int ldx, int Kp, uint8_t *q, float *sa, float *mn, int nt);
void q8_quant_act_bf16(const uint16_t *x, int M, int K, int ldx, int Kp, uint8_t *q, float *sa, float *mn, int nt);
void q8_gemm_f32(const uint8_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                 const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, float *y, int ldy, int nt);
void q8_gemm_bf16(const uint8_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                  const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, uint16_t *y, int ldy, int nt);
void q8_linear_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, const int16_t *ws,
                   int Np, int N, int wmax, float *y, int ldy, int nt);
void q8_linear_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, const int16_t *ws,
                    int Np, int N, int wmax, uint16_t *y, int ldy, int nt);
void q8_linear_glu_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                       const int16_t *ws, int Np, int N, int wmax, int act, float *y, int ldy, int nt);
void q8_linear_glu_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                        const int16_t *ws, int Np, int N, int wmax, int act, uint16_t *y, int ldy, int nt);
void q8_gemm_argmax(const uint8_t *q0, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                    const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, int64_t *idx, float *val, int nt);
int q8_prompt_amx(void);   /* 1: q8_linear_amx_* run here (AMX-BF16 tiles) */
int q8_linear_amx_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np, int N,
                      int glu, float *y, int ldy, int nt);
int q8_linear_amx_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np, int N,
                       int glu, uint16_t *y, int ldy, int nt);
int q8_linear_amx_mixed(const void *x, int x_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np,
                        int N, int glu, void *y, int y_bf16, int ldy, int nt);   /* float32 math, one side bf16 */
void q8_embed_f32(const int8_t *w, const uint16_t *sw, int Kp, const int64_t *ids, int T, int K, float *y, int nt);
void q8_embed_bf16(const int8_t *w, const uint16_t *sw, int Kp, const int64_t *ids, int T, int K, uint16_t *y, int nt);

/* ---- matmuls (bf16_gemm/, small_m/, panel/) ---- */
void bf16_gemm(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M, int N,
               int K2, int nt);
void small_m_linear_bf16(const uint16_t *x, int32_t M, int32_t K, const uint16_t *w, int64_t N, uint16_t *y,
                         int32_t nt);
void small_m_linear_f32(const float *x, int32_t M, int32_t K, const float *w, int64_t N, float *y, int32_t nt);
/* float32 x and y, bf16 weights (each widened to float32: the bits of small_m_linear_f32 over their float32 copy) */
void small_m_linear_f32_bf16w(const float *x, int32_t M, int32_t K, const uint16_t *w, int64_t N, float *y,
                              int32_t nt);

/* float32 x and y over weights packed in panels of 16 rows (panel/driver.h), float32 (pb 0) or bf16 (pb 1) */
void panel_linear_f32(const float *x, int32_t M, int32_t K, const void *panels, int32_t pb, int64_t N, float *y,
                      int32_t nt);
void panel_pack(const void *w, int32_t wb, int64_t N, int32_t K, void *panels, int32_t pb);
void panel_unpack_f32(const void *panels, int32_t pb, int64_t N, int32_t K, float *w);

/* ---- n-gram speculation (ngram.c) ---- */
void ngram_propose_batch(const int32_t *ctx, const int64_t *offsets, int32_t num_reqs, int32_t n_min, int32_t n_max,
                         int32_t k, int32_t *out, int32_t *counts);

#endif
