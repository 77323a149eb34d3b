/* Prompt rows of an int8 linear on AMX-BF16 tiles (included by avx512_vnni.c in builds whose flags have AMX-TILE,
 * AMX-BF16 and AVX512-BF16, dispatch.h's QLINEAR_AMX_BF16): y = bf16(x) @ bf16(W)^T with float32 sums, W's int8
 * values dequantized (quant x its fp16 scale: an exact float32 product, rounded once to bf16) pair by pair as the
 * call runs. No per-group epilogue: the scale is in the weight, so a tile's sums run over all of K. The int8 dot
 * products' path (the VNNI tiles) quantizes activations to 8 bits per group of 32 and scales every group's sum in
 * float, and that epilogue bounds it far under AMX's bf16 tiles (measured: docs/perf/xeon-amx.md); bf16
 * activations keep more of x than the 8-bit quants do.
 *
 * Which rows take it is the caller's (engine.quant.int8: the prompt rows when the `int8_prompts` family says "bf16");
 * it is another arithmetic than the int8 dot products', so a position is always computed by one of them (an output
 * position never here): a row's bits never depend on which other rows share its call. Every row is computed by the
 * same tile instructions wherever it sits (rows padded to 16 with zeros, K padded to 32 by the packing), and each
 * output's sum runs over K in the same order for every call.
 *
 * Work: a thread takes whole 32-column pairs; per pair it dequantizes the pair into a panel in the B operand's
 * layout (Kp/2 rows of 32 columns x a bf16 pair), then runs every 32-row block of x against it: 2 A tiles
 * (16 rows x 16 pairs), 2 B tiles (16 pairs x 16 columns), 4 C tiles. */
#ifndef BATCHGEN_QLINEAR_AMX_PROMPT_H
#define BATCHGEN_QLINEAR_AMX_PROMPT_H

#include <immintrin.h>

#include "../amx.h"

static void amx_prompt_begin(void) { amx_config_tiles(8); }   /* A0, A1, B0, B1, C00, C01, C10, C11 */

/* the pair's weights (two 16-column blocks of the packed int8 layout, driver.h) as bf16 pairs: panel[j * 32 + c] =
 * (W[c][2j], W[c][2j+1]) for the pair's columns c, each value bf16(q * scale) */
static void dequant_pair(const int8_t *w, const uint16_t *sw, int Kp, uint32_t *panel) {
    const int K4 = Kp / 4, G = Kp / QK;
    for (int nb = 0; nb < 2; nb++)
        for (int k4 = 0; k4 < K4; k4++) {
            const __m512i v = _mm512_loadu_si512(w + ((size_t)nb * K4 + k4) * 64);   /* lane: 4 k of a column */
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sw + ((size_t)nb * G + k4 / 8) * 16)));
            const __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)), s);
            const __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)), s);
            const __m512 f2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)), s);
            const __m512 f3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)), s);
            /* bf16 bits (round to nearest even) in the low half of each lane, the pair's second value above */
            const __m512i h0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f0));
            const __m512i h1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f1));
            const __m512i h2 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f2));
            const __m512i h3 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f3));
            _mm512_storeu_si512(panel + (size_t)(2 * k4) * 32 + nb * 16, _mm512_or_si512(h0, _mm512_slli_epi32(h1, 16)));
            _mm512_storeu_si512(panel + (size_t)(2 * k4 + 1) * 32 + nb * 16,
                                _mm512_or_si512(h2, _mm512_slli_epi32(h3, 16)));
        }
}

/* y[M, N] (row stride ldy, float32 or bf16; GLU-fused as driver.h's store_rows) = bf16(x) @ bf16(W)^T; x [M, K]
 * (float32, or bf16 with is_bf16) at row stride ldx. Returns 0 (nothing written) where the tiles may not run. */
static int amx_prompt_linear(const void *x, int is_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                             int Np, int N, void *y, int ldy, int glu, int nt) {
    if (M <= 0) return 1;
    if (!amx_available()) return 0;
    const int Kp = (K + QK - 1) / QK * QK, K2 = Kp / 2, K4 = Kp / 4, G = Kp / QK, npair = Np / 32;
    const int Mp = (M + 31) / 32 * 32;
    /* x as bf16, rows padded to whole 32-row blocks and K to Kp with zeros */
    uint16_t *xa = (uint16_t *)aligned_alloc(64, (size_t)Mp * Kp * 2);
#pragma omp parallel for schedule(static) num_threads(nt) if (M > 8)
    for (int m = 0; m < Mp; m++) {
        uint16_t *dst = xa + (size_t)m * Kp;
        if (m >= M) {
            memset(dst, 0, (size_t)Kp * 2);
            continue;
        }
        for (int k = 0; k < Kp; k++)
            dst[k] = k < K ? (is_bf16 ? ((const uint16_t *)x)[(size_t)m * ldx + k]
                                      : f32_to_bf16(((const float *)x)[(size_t)m * ldx + k]))
                           : 0;
    }
#pragma omp parallel num_threads(nt)
    {
        uint32_t *panel = (uint32_t *)aligned_alloc(64, (size_t)K2 * 32 * 4);
        float acc[32][32] __attribute__((aligned(64)));
        amx_prompt_begin();
#pragma omp for schedule(static)
        for (int np = 0; np < npair; np++) {
            dequant_pair(w + (size_t)np * 2 * K4 * 64, sw + (size_t)np * 2 * G * 16, Kp, panel);
            const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
            for (int m = 0; m < Mp; m += 32) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                const uint16_t *a = xa + (size_t)m * Kp;
                for (int j0 = 0; j0 < K2; j0 += 16) {
                    _tile_loadd(0, a + 2 * (size_t)j0, Kp * 2);
                    _tile_loadd(1, a + (size_t)16 * Kp + 2 * (size_t)j0, Kp * 2);
                    _tile_loadd(2, panel + (size_t)j0 * 32, 128);
                    _tile_loadd(3, panel + (size_t)j0 * 32 + 16, 128);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 0, 3);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_dpbf16ps(7, 1, 3);
                }
                _tile_stored(4, &acc[0][0], 128);
                _tile_stored(5, &acc[0][16], 128);
                _tile_stored(6, &acc[16][0], 128);
                _tile_stored(7, &acc[16][16], 128);
                const int R = M - m < 32 ? M - m : 32;
                store_rows(acc, R, m, np, ncols, y, ldy, is_bf16, glu);
            }
        }
        _tile_release();
        free(panel);
    }
    free(xa);
    return 1;
}

#endif
