/* Int8 linear layers: y = x @ W^T with W in int8 (per row, per group of 32 along K, one fp16 scale: llama.cpp's
 * Q8_0 grouping; with each group's int16 sum of quants, 1.125 bytes a weight) and x quantized on the fly to uint8
 * per token and group of 32, asymmetric (a scale and the group minimum: x ~= sa * q + mn). Asymmetric activations
 * matter: GeGLU outputs are skewed, and symmetric int8 doubled the model's KL divergence against float32 (measured
 * on gemma-3-270m).
 *
 * Per output (m, n):  y = sum_g  sw[n,g] * sa[m,g] * dot_g(q[m], W[n])  +  mn[m,g] * cw[n,g]
 * where dot_g is an exact int32 dot product over the group and cw[n,g] = sw[n,g] * ws[n,g], ws[n,g] = sum_k W[n,k]
 * over the group (exact, stored as int16 beside the scales; cw is one float32 rounding, the same in every path).
 * Where a build has HAVE_FUSED, its tiles of few rows (decode) sum the group's quants themselves with two more
 * integer dot products on the weight vectors already loaded and never read ws: those memory-bound calls read 1.0625
 * bytes a weight (docs/perf/code-notes-kernels.md). The integer dot products run on the best unit the build has, one
 * implementation file each (dispatch.h picks one; batchgen_q8_isa() names it):
 *
 *   avx512_vnni.c  vpdpbusd: u8 x s8, four products summed into each int32 lane, 16 lanes
 *   avx2.c         vpmaddubsw (u8 x s8, pairs summed into int16) with vpmaddwd by ones into int32, llama.cpp's
 *                  AVX2 dot product. Its int16 pair sums would saturate for u8 255 x s8 127, so weights within
 *                  +-64 (wmax, the callers' bound) are multiplied directly (pair sums <= 2 * 255 * 64), and wider
 *                  ones by the centred quants: |q - 128| (<= 128) times sign(q - 128) * w (vpsignb), pair sums
 *                  <= 2 * 128 * 127, with the minimum folded to mn + 128 * sa (block16: WIDE). Weights within
 *                  +-16 (the default GGUF's Q5_0 tensors) add four steps' pair sums in int16 before one vpmaddwd
 *                  (block16_short).
 *   portable.c     plain C loops over the same packed layout: the reference the others are tested against
 *
 * Packed weight layout (Np = N rounded up to 32, Kp = K rounded up to 32, K4 = Kp / 4, G = Kp / 32):
 *   w [(nb * K4 + k4) * 64 + lane * 4 + j] = W[nb * 16 + lane][k4 * 4 + j]       (int8, zero padding)
 *   sw[(nb * G + g) * 16 + lane] (fp16), ws[(nb * G + g) * 16 + lane] (int16)
 * so one 64-byte load gives 16 output columns x 4 consecutive k, the operand shape of vpdpbusd.
 * Activations: q[m * Kp + k] (uint8, every build), sa/mn[m * G + g].
 *
 * This header is what the implementations share: the activation quantization's scalar loop, the work split, the
 * stores (GLU fused) and the exported functions. An implementation file defines MR (rows per micro-tile) and, where
 * it has them, HAVE_QUANT_GROUP (a vector quant_group), HAVE_WIDE (the wide-weight tile paths) and HAVE_FUSED with
 * FUSED_MAX_ROWS (tiles of calls with at most that many rows sum the quants themselves); includes this header; then
 * defines the functions declared below under "each implementation defines".
 */
#ifndef BATCHGEN_QLINEAR_DRIVER_H
#define BATCHGEN_QLINEAR_DRIVER_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../common.h"
#include "../kernels.h"

typedef uint8_t qact_t;

#define QK 32          /* group size along K */
/* the avx2 implementation's dot-product paths by weight bound (its tile_input): within +-16, within +-64, any
 * weights; the other implementations always take PATH_DIRECT */
enum { PATH_DIRECT = 0, PATH_SIGN = 1, PATH_SHORT = 2 };
#define MC (MR * 10)   /* rows per work item (they stay in L1/L2 while the weight blocks stream past) */

/* ---- each implementation defines ------------------------------------------------------------------------ */

#ifdef HAVE_QUANT_GROUP
/* One whole group of 32 (at x + i) in vector registers: the same values as quant_row's scalar loop (min and max
 * are exact, (x - lo) * inv is the same float arithmetic, and vcvtps2dq rounds to nearest even like lrintf under
 * the default rounding mode); tests compare every build's quants with the portable build's. */
static void quant_group(const void *x, int is_bf16, size_t i, qact_t *q, float *sa, float *mn);
#endif
/* R (<= MR) rows x 32 columns (two 16-column weight blocks), all of K, into acc; WIDE one of the PATH_* and FUSED
 * (0, or 1 with HAVE_FUSED: the group sums from the quants, ws unread) compile-time constants at every call
 * (tile_rows). sw, ws: the pair's fp16 scales and int16 group sums. pf: NULL, or the weights of the pair the
 * thread takes next, which the tile prefetches into L2 line by line (prefetch_line) as it reads its own. */
static void tile(const int R, const int WIDE, const int FUSED, const qact_t *q, int ldq, int Kp, const float *sa,
                 const float *mn, const int8_t *w, const uint16_t *sw, const int16_t *ws, const int8_t *pf,
                 float acc[MR][32]);
#ifndef HAVE_FUSED
#define FUSED_MAX_ROWS 0   /* the rows of a call up to which its tiles sum the quants themselves */
#endif
/* The activations as the tiles read them (row stride *ldq) and the path for weights bounded by wmax (*wide). Where
 * they are a copy of q's rows made for the path, *owned is set and the caller frees it. */
static const qact_t *tile_input(const qact_t *q, int M, int Kp, int wmax, int nt, int *wide, int *ldq,
                                qact_t **owned);

/* ---- prefetching the next weight pair ------------------------------------------------------------------
 * A tile reads its pair's weights once from memory; the hardware prefetchers alone left the memory stream and the
 * integer products overlapping poorly at 8-16 rows (the next pair's lines were fetched only when touched). So the
 * first tile a thread runs over its last row chunk of a pair prefetches the thread's next pair, one 64-byte line
 * for each line it reads, into L2 (prefetcht1: a pair is Kp x 32 bytes, up to ~300 KB for the widest K, where L1
 * would evict the pair in use). Measured in docs/perf/code-notes-kernels.md. */
static inline __attribute__((always_inline)) void prefetch_line(const int8_t *pf, size_t off) {
    if (pf) __builtin_prefetch(pf + off, 0, 2);
}

/* ---- activation quantization: one row, asymmetric, per group of 32 --------------------------------- */

static inline float load_x(const void *x, int is_bf16, size_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static void quant_row(const void *x, int is_bf16, size_t off, int K, int Kp, qact_t *q, float *sa, float *mn) {
    for (int g = 0; g * QK < Kp; g++) {
        const int k0 = g * QK, k1 = k0 + QK < K ? k0 + QK : K;
#ifdef HAVE_QUANT_GROUP
        if (k1 - k0 == QK) {
            quant_group(x, is_bf16, off + k0, q + k0, sa + g, mn + g);
            continue;
        }
#endif
        float lo = 0.0f, hi = 0.0f;
        if (k0 < K) {
            lo = hi = load_x(x, is_bf16, off + k0);
            for (int k = k0 + 1; k < k1; k++) {
                const float v = load_x(x, is_bf16, off + k);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
        }
        const float s = (hi - lo) / 255.0f;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        sa[g] = s;
        mn[g] = lo;
        for (int k = k0; k < k0 + QK; k++) {
            int v = 0;
            if (k < K) {
                v = (int)lrintf((load_x(x, is_bf16, off + k) - lo) * inv);
                v = v < 0 ? 0 : (v > 255 ? 255 : v);
            }
            q[k] = (qact_t)v;
        }
    }
}

/* Activations of fewer than QUANT_PAR_MIN elements are quantized on the calling thread (and, on the avx2 build,
 * centred: centre_rows): a decode step's rows take less time alone than waking the second thread costs, which sleeps
 * between a step's regions under batchgen's short barrier spin (engine/omp_wait.py; measured: docs/perf/xeon-amx.md).
 * Each row is quantized alone: the same quants either way. */
#define QUANT_PAR_MIN 65536

static void quant_act(const void *x, int is_bf16, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn,
                      int nt) {
    const int G = Kp / QK;
#pragma omp parallel for schedule(static) num_threads(nt) if ((int64_t)M * K >= QUANT_PAR_MIN)
    for (int m = 0; m < M; m++)
        quant_row(x, is_bf16, (size_t)m * ldx, K, Kp, q + (size_t)m * Kp, sa + (size_t)m * G, mn + (size_t)m * G);
}

void q8_quant_act_f32(const float *x, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn, int nt) {
    quant_act(x, 0, M, K, ldx, Kp, q, sa, mn, nt);
}
void q8_quant_act_bf16(const uint16_t *x, int M, int K, int ldx, int Kp, qact_t *q, float *sa, float *mn, int nt) {
    quant_act(x, 1, M, K, ldx, Kp, q, sa, mn, nt);
}

/* ---- store one tile row of 32 float results (fewer at the right edge) --------------------------------- */

static inline void store_row(const float *acc, void *out, int is_bf16, size_t off, int ncols) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out + off;
        for (int j = 0; j < ncols; j++) o[j] = f32_to_bf16(acc[j]);
    } else {
        float *o = (float *)out + off;
        for (int j = 0; j < ncols; j++) o[j] = acc[j];
    }
}

/* ---- the gated MLP's gate_up projection with its GLU fused in ------------------------------------------
 * With the weight rows interleaved in blocks of 16 (gate rows 16b..16b+15, then up rows 16b..16b+15: a tile's two
 * 16-column blocks; engine.quant.int8.glu_interleave), a tile's 32 results per row are 16 gates and their 16 ups,
 * and out[m, 16 * pair + j] = act(gate_j) * up_j is written instead of the [M, 2I] gate_up product: the GLU's
 * read-back of that product and its separate pass are gone. A bf16 output rounds gate and up to bf16 first, as
 * the unfused path (q8_linear_bf16, then elementwise.c's GLU on its bf16 output) does: the same bits either way. */
enum { GLU_NONE = 0, GLU_GELU_TANH = 1, GLU_SILU = 2 };

static inline float as_stored(float x, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline void store_glu(const float *acc, void *out, int is_bf16, size_t off, int act) {
    float o[16];
    if (act == GLU_SILU) {
#pragma omp simd
        for (int j = 0; j < 16; j++) o[j] = silu(as_stored(acc[j], is_bf16)) * as_stored(acc[16 + j], is_bf16);
    } else {
#pragma omp simd
        for (int j = 0; j < 16; j++) o[j] = gelu_tanh(as_stored(acc[j], is_bf16)) * as_stored(acc[16 + j], is_bf16);
    }
    store_row(o, out, is_bf16, off, 16);
}

/* Rows m..m+R-1 of the pair np's results (acc, R rows of 32): the GLU's 16 outputs, or up to 32 columns. */
static inline void store_rows(float (*acc)[32], int R, int m, int np, int ncols, void *y, int ldy, int is_bf16,
                              int glu) {
    if (glu)   /* N = 2I, I a multiple of 16 (the caller checks): every pair is whole */
        for (int r = 0; r < R; r++) store_glu(acc[r], y, is_bf16, (size_t)(m + r) * ldy + np * 16, glu);
    else
        for (int r = 0; r < R; r++) store_row(acc[r], y, is_bf16, (size_t)(m + r) * ldy + np * 32, ncols);
}

/* R (1..MR) rows of a tile: constant R, WIDE and FUSED per case, so the compiler unrolls each case's row loops. */
#define TILE(R_, WIDE, FUSED) tile(R_, WIDE, FUSED, q, ldq, Kp, sa, mn, w, sw, ws, pf, acc)
#define TILE_CASES(WIDE, FUSED)                                                                   \
    switch (R) {                                                                                  \
    ROWS_6_5(WIDE, FUSED) ROWS_4(WIDE, FUSED) ROWS_3(WIDE, FUSED)                                 \
    case 2: TILE(2, WIDE, FUSED); break;                                                          \
    default: TILE(1, WIDE, FUSED); break;                                                         \
    }
#if MR >= 6
#define ROWS_6_5(WIDE, FUSED) case 6: TILE(6, WIDE, FUSED); break; case 5: TILE(5, WIDE, FUSED); break;
#else
#define ROWS_6_5(WIDE, FUSED)
#endif
#if MR >= 4
#define ROWS_4(WIDE, FUSED) case 4: TILE(4, WIDE, FUSED); break;
#else
#define ROWS_4(WIDE, FUSED)
#endif
#if MR >= 3
#define ROWS_3(WIDE, FUSED) case 3: TILE(3, WIDE, FUSED); break;
#else
#define ROWS_3(WIDE, FUSED)
#endif
#ifdef HAVE_FUSED
#define PATH_CASES(WIDE)                                                                          \
    if (fused) TILE_CASES(WIDE, 1) else TILE_CASES(WIDE, 0)
#else
#define PATH_CASES(WIDE) TILE_CASES(WIDE, 0)
#endif

/* One tile of R rows by the path for the weights' bound (wide), fused (the group sums from the quants) or not. */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int wide, const int fused,
                                                            const qact_t *q, int ldq, int Kp, const float *sa,
                                                            const float *mn, const int8_t *w, const uint16_t *sw,
                                                            const int16_t *ws, const int8_t *pf, float acc[MR][32]) {
    (void)fused;
#ifdef HAVE_WIDE
    if (wide == PATH_SIGN) {
        PATH_CASES(PATH_SIGN)
        return;
    }
    if (wide == PATH_SHORT) {
        PATH_CASES(PATH_SHORT)
        return;
    }
#else
    (void)wide;
#endif
    PATH_CASES(PATH_DIRECT)
}

/* y[M, N] (row stride ldy, float32 or bf16) = dequant(q) @ W^T. Work items: (32-column pair of weight blocks, row
 * chunk), split over the OpenMP threads pair-major: a thread keeps its pair (Kp x 32 bytes) in L1/L2 while every
 * chunk's MR-row tiles stream past it (the activations are the smaller operand: 6 rows a tile against 32 columns).
 * Pair-major measured ~10 % faster than chunk-major at prefill sizes on Zen 4 (docs/perf/code-notes-kernels.md);
 * the values are the same either way (each output is one tile's, whatever the order). */
static void gemm(const qact_t *q0, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                 const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, void *y, int ldy, int is_bf16,
                 int glu, int nt) {
    if (M <= 0) return;
    const int G = Kp / QK, K4 = Kp / 4, npair = Np / 32;
    /* chunks of at most MC rows, of equal size (in whole tiles) */
    const int chunks = (M + MC - 1) / MC, even = (M + chunks - 1) / chunks;
    const int mcr = (even + MR - 1) / MR * MR, nmc = (M + mcr - 1) / mcr;
    const int fused = M <= FUSED_MAX_ROWS;
    int wide, ldq;
    qact_t *owned;
    const qact_t *q = tile_input(q0, M, Kp, wmax, nt, &wide, &ldq, &owned);
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int np = 0; np < npair; np++)
        for (int mc = 0; mc < nmc; mc++) {
            const int8_t *wp = w + (size_t)np * 2 * K4 * 64;
            const uint16_t *swp = sw + (size_t)np * 2 * G * 16;
            const int16_t *wsp = ws + (size_t)np * 2 * G * 16;
            const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
            const int m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            /* the next pair's weights, fetched while this pair's last chunk runs (prefetch_line) */
            const int8_t *next = mc == nmc - 1 && np + 1 < npair ? wp + (size_t)2 * K4 * 64 : NULL;
            float acc[MR][32];
            for (int m = mc * mcr; m < m_end; m += MR) {
                const int R = m_end - m < MR ? m_end - m : MR;
                const float *sam = sa + (size_t)m * G, *mnm = mn + (size_t)m * G;
                tile_rows(R, wide, fused, q + (size_t)m * ldq, ldq, Kp, sam, mnm, wp, swp, wsp,
                          m == mc * mcr ? next : NULL, acc);
                store_rows(acc, R, m, np, ncols, y, ldy, is_bf16, glu);
            }
        }
    free(owned);
}

/* Output forms of amx_prompt.h's amx_prompt_linear (its `out`): float32; bf16, a GLU's gate and up rounded to bf16
 * first (the unfused bf16 path's product: the model's activations in bf16); bf16 rounded once from the float32
 * result (float32 activations whose consumer reads them as bf16 anyway: the next prompt-row linear's packing rounds
 * the same way) */
enum { AMX_OUT_F32 = 0, AMX_OUT_BF16 = 1, AMX_OUT_F32_AS_BF16 = 2 };

#if QLINEAR_ISA == ISA_AVX512_VNNI && QLINEAR_AMX_BF16
#include "amx_prompt.h"   /* prompt rows on AMX-BF16 tiles over the weights dequantized to bf16 */
#endif

/* Whether q8_linear_amx_* can run here (the build has AMX-BF16 and the process may use the tiles). */
int q8_prompt_amx(void) {
#if QLINEAR_ISA == ISA_AVX512_VNNI && QLINEAR_AMX_BF16
    return amx_available();
#else
    return 0;
#endif
}

/* y = bf16(x) @ bf16(W)^T (amx_prompt.h), float32 sums; glu 0 or driver.h's GLU_* (a gate_up weight interleaved as
 * for q8_linear_glu_*: y [M, N / 2]); out: amx_prompt.h's AMX_OUT_*. Returns 0, writing nothing, where
 * q8_prompt_amx() is 0. */
static int linear_amx(const void *x, int is_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np,
                      int N, void *y, int ldy, int out, int glu, int nt) {
#if QLINEAR_ISA == ISA_AVX512_VNNI && QLINEAR_AMX_BF16
    return amx_prompt_linear(x, is_bf16, M, K, ldx, w, sw, Np, N, y, ldy, out, glu, nt);
#else
    (void)x, (void)is_bf16, (void)M, (void)K, (void)ldx, (void)w, (void)sw, (void)Np, (void)N, (void)y, (void)ldy;
    (void)out, (void)glu, (void)nt;
    return 0;
#endif
}
int q8_linear_amx_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np, int N,
                      int glu, float *y, int ldy, int nt) {
    return linear_amx(x, 0, M, K, ldx, w, sw, Np, N, y, ldy, AMX_OUT_F32, glu, nt);
}
int q8_linear_amx_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np, int N,
                       int glu, uint16_t *y, int ldy, int nt) {
    return linear_amx(x, 1, M, K, ldx, w, sw, Np, N, y, ldy, AMX_OUT_BF16, glu, nt);
}
/* float32 activations with one side in bf16: x_bf16 (x holds float32 values rounded to bf16: the same products as
 * the float32 x, which the tiles round the same way) or y_bf16 (the float32 result rounded once to bf16, a GLU's
 * gate and up kept float32) */
int q8_linear_amx_mixed(const void *x, int x_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, int Np,
                        int N, int glu, void *y, int y_bf16, int ldy, int nt) {
    return linear_amx(x, x_bf16, M, K, ldx, w, sw, Np, N, y, ldy, y_bf16 ? AMX_OUT_F32_AS_BF16 : AMX_OUT_F32, glu, nt);
}

/* wmax: max|w| of the packed weights (a bound: larger is always correct; the avx2 build takes its faster path
 * only for wmax <= 64) */
void q8_gemm_f32(const qact_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                 const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, float *y, int ldy, int nt) {
    gemm(q, sa, mn, M, Kp, w, sw, ws, Np, N, wmax, y, ldy, 0, GLU_NONE, nt);
}
void q8_gemm_bf16(const qact_t *q, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                  const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, uint16_t *y, int ldy, int nt) {
    gemm(q, sa, mn, M, Kp, w, sw, ws, Np, N, wmax, y, ldy, 1, GLU_NONE, nt);
}

/* x [M, K] (row stride ldx, float32 or bf16) @ W^T in one call: the activations quantized into scratch of this
 * call's own, then gemm. The same quants and products as q8_quant_act_* + q8_gemm_*, without the two extra
 * calls and three scratch tensors per linear on the Python side (72 linears per decode step of gemma-3-270m). */
static void linear(const void *x, int is_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                   const int16_t *ws, int Np, int N, int wmax, void *y, int ldy, int glu, int nt) {
    if (M <= 0) return;
    const int Kp = (K + QK - 1) / QK * QK, G = Kp / QK;
    qact_t *q = (qact_t *)malloc((size_t)M * Kp + sizeof(float) * 2 * (size_t)M * G);
    float *sa = (float *)(q + (size_t)M * Kp), *mn = sa + (size_t)M * G;   /* Kp is a multiple of 32: aligned */
    quant_act(x, is_bf16, M, K, ldx, Kp, q, sa, mn, nt);
    gemm(q, sa, mn, M, Kp, w, sw, ws, Np, N, wmax, y, ldy, is_bf16, glu, nt);
    free(q);
}

void q8_linear_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, const int16_t *ws,
                   int Np, int N, int wmax, float *y, int ldy, int nt) {
    linear(x, 0, M, K, ldx, w, sw, ws, Np, N, wmax, y, ldy, GLU_NONE, nt);
}
void q8_linear_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw, const int16_t *ws,
                    int Np, int N, int wmax, uint16_t *y, int ldy, int nt) {
    linear(x, 1, M, K, ldx, w, sw, ws, Np, N, wmax, y, ldy, GLU_NONE, nt);
}

/* x @ W^T for a gate_up weight interleaved in 16-row blocks (see store_glu), then the GLU: y [M, N / 2] (row
 * stride ldy). act: GLU_GELU_TANH or GLU_SILU; N a multiple of 32. */
void q8_linear_glu_f32(const float *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                       const int16_t *ws, int Np, int N, int wmax, int act, float *y, int ldy, int nt) {
    linear(x, 0, M, K, ldx, w, sw, ws, Np, N, wmax, y, ldy, act == GLU_SILU ? GLU_SILU : GLU_GELU_TANH, nt);
}
void q8_linear_glu_bf16(const uint16_t *x, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                        const int16_t *ws, int Np, int N, int wmax, int act, uint16_t *y, int ldy, int nt) {
    linear(x, 1, M, K, ldx, w, sw, ws, Np, N, wmax, y, ldy, act == GLU_SILU ? GLU_SILU : GLU_GELU_TANH, nt);
}

/* Greedy decoding's LM head: per row, the largest y[m, n] = dequant(q) @ W^T and its index (the first on ties,
 * like argmax), without writing y (a [rows, 262144] float32 block per decode step). Each thread scans a
 * contiguous range of 32-column pairs in order with the same tiles as gemm (so the values compared are gemm's,
 * bit for bit); the ranges are merged in order. A NaN never wins. */
void q8_gemm_argmax(const qact_t *q0, const float *sa, const float *mn, int M, int Kp, const int8_t *w,
                    const uint16_t *sw, const int16_t *ws, int Np, int N, int wmax, int64_t *idx, float *val, int nt) {
    const int G = Kp / QK, K4 = Kp / 4, npair = Np / 32;
    nt = nt < 1 ? 1 : nt;
    int wide, ldq;
    qact_t *owned;
    const qact_t *q = tile_input(q0, M, Kp, wmax, nt, &wide, &ldq, &owned);
    /* per thread and row, the best value and its column for each of the 32 tile columns (j = column % 32): the
     * comparisons are branch-free and vectorize; the 32 lanes are reduced once at the end */
    float *bv = (float *)malloc(sizeof(float) * (size_t)nt * M * 32);
    int32_t *bi = (int32_t *)malloc(sizeof(int32_t) * (size_t)nt * M * 32);
    int used = 1;
#pragma omp parallel num_threads(nt)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
#pragma omp single
        used = nth;
        float *v = bv + (size_t)tid * M * 32;
        int32_t *ix = bi + (size_t)tid * M * 32;
        for (int i = 0; i < M * 32; i++) { v[i] = -INFINITY; ix[i] = 0; }
        const int p0 = (int)((int64_t)npair * tid / nth), p1 = (int)((int64_t)npair * (tid + 1) / nth);
        float acc[MR][32];
        const int fused = M <= FUSED_MAX_ROWS;
        for (int np = p0; np < p1; np++) {
            const int8_t *wp = w + (size_t)np * 2 * K4 * 64;
            const uint16_t *swp = sw + (size_t)np * 2 * G * 16;
            const int16_t *wsp = ws + (size_t)np * 2 * G * 16;
            const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
            for (int m = 0; m < M; m += MR) {
                const int R = M - m < MR ? M - m : MR;
                const float *sam = sa + (size_t)m * G, *mnm = mn + (size_t)m * G;
                const int8_t *next = m == 0 && np + 1 < p1 ? wp + (size_t)2 * K4 * 64 : NULL;
                tile_rows(R, wide, fused, q + (size_t)m * ldq, ldq, Kp, sam, mnm, wp, swp, wsp, next, acc);
                for (int r = 0; r < R; r++) {
                    float *vr = v + (size_t)(m + r) * 32;
                    int32_t *ir = ix + (size_t)(m + r) * 32;
                    for (int j = 0; j < 32; j++) {      /* strict >: a lane keeps its first maximum; NaN never wins */
                        const int better = j < ncols && acc[r][j] > vr[j];
                        vr[j] = better ? acc[r][j] : vr[j];
                        ir[j] = better ? np * 32 + j : ir[j];
                    }
                }
            }
        }
    }
    /* merge: the largest value over threads and lanes, the lowest column among equal ones (argmax's first) */
    for (int m = 0; m < M; m++) {
        float best = -INFINITY;
        int64_t at = 0;
        for (int t = 0; t < used; t++)
            for (int j = 0; j < 32; j++) {
                const float x = bv[((size_t)t * M + m) * 32 + j];
                const int64_t c = bi[((size_t)t * M + m) * 32 + j];
                if (x > best || (x == best && x > -INFINITY && c < at)) { best = x; at = c; }
            }
        idx[m] = at;
        val[m] = best;
    }
    free(bv);
    free(bi);
    free(owned);
}

#endif
