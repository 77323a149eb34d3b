/* bf16_gemm on AMX-BF16 tiles (included by avx512_bf16.c in builds whose flags have AMX-TILE and AMX-BF16,
 * dispatch.h's BF16_GEMM_AMX): 16 rows x 32 columns per output tile, 16 pairs along K per TDPBF16PS, float32
 * accumulation in the tile. bp's pair layout (bf16_gemm.h) already is the B operand's: a tile row is one pair index j,
 * its 64 bytes 16 columns' (b[2j][n], b[2j+1][n]).
 *
 * Every row and column is computed by the same tile instructions wherever it sits: edges (rows, columns or pairs
 * short of a whole tile) are copied into zero-padded scratch, never sent to the vector micro-kernel, so a query's
 * scores and output do not depend on how many rows shared its call (a prompt's chunking). The tile unit's sums are
 * not vdpbf16ps's bit for bit; a process takes one or the other for all of its calls (amx_available()). */
#ifndef BATCHGEN_BF16_GEMM_AMX_TILES_H
#define BATCHGEN_BF16_GEMM_AMX_TILES_H

#include <immintrin.h>

#include "../amx.h"

#define AMX_GR 16
#define AMX_GC 32

/* amx_tile's tiles 0: A (16 rows x 16 pairs), 1-2: B (16 pairs x 16 columns, two column halves), 3-4: C (16 x 16
 * float32); amx_block's 0-1: A, 2-3: B, 4-7: C */
static void amx_begin(void) { amx_config_tiles(8); }

static void amx_tile(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M,
                     int N, int K2, int rt, int ct) {
    const int m = rt * AMX_GR, n = ct * AMX_GC;
    const int R = M - m < AMX_GR ? M - m : AMX_GR, ncols = N - n < AMX_GC ? N - n : AMX_GC;
    uint16_t as[16][32] __attribute__((aligned(64)));
    uint32_t bs[2][16][16] __attribute__((aligned(64)));
    float cs[2][16][16] __attribute__((aligned(64)));
    _tile_zero(3);
    _tile_zero(4);
    for (int j0 = 0; j0 < K2; j0 += 16) {
        const int kk = K2 - j0 < 16 ? K2 - j0 : 16;
        const uint16_t *ap = a + (int64_t)m * lda + 2 * (int64_t)j0;
        if (R == 16 && kk == 16) {
            _tile_loadd(0, ap, lda * 2);
        } else {
            memset(as, 0, sizeof as);
            for (int r = 0; r < R; r++) memcpy(as[r], ap + (int64_t)r * lda, (size_t)kk * 4);
            _tile_loadd(0, as, 64);
        }
        const uint32_t *b0 = bp + (int64_t)j0 * ldb + n;
        if (ncols >= 16 && kk == 16) {
            _tile_loadd(1, b0, ldb * 4);
        } else {
            memset(bs[0], 0, sizeof bs[0]);
            for (int j = 0; j < kk; j++) memcpy(bs[0][j], b0 + (int64_t)j * ldb, (size_t)(ncols < 16 ? ncols : 16) * 4);
            _tile_loadd(1, bs[0], 64);
        }
        _tile_dpbf16ps(3, 0, 1);
        if (ncols > 16) {
            if (ncols == 32 && kk == 16) {
                _tile_loadd(2, b0 + 16, ldb * 4);
            } else {
                memset(bs[1], 0, sizeof bs[1]);
                for (int j = 0; j < kk; j++) memcpy(bs[1][j], b0 + 16 + (int64_t)j * ldb, (size_t)(ncols - 16) * 4);
                _tile_loadd(2, bs[1], 64);
            }
            _tile_dpbf16ps(4, 0, 2);
        }
    }
    float *cr = c + (int64_t)m * ldc + n;
    if (R == 16 && ncols == 32) {
        _tile_stored(3, cr, ldc * 4);
        _tile_stored(4, cr + 16, ldc * 4);
        return;
    }
    _tile_stored(3, cs[0], 64);
    _tile_stored(4, cs[1], 64);
    for (int r = 0; r < R; r++) {
        memcpy(cr + (int64_t)r * ldc, cs[0][r], (size_t)(ncols < 16 ? ncols : 16) * 4);
        if (ncols > 16) memcpy(cr + (int64_t)r * ldc + 16, cs[1][r], (size_t)(ncols - 16) * 4);
    }
}

/* The 32 x 32 output block at rows m, columns n of c, all of whose rows and columns exist: per k-step 2 A tiles (rows
 * m, m + 16) and 2 B tiles (columns n, n + 16) into 4 C tiles, so each loaded tile feeds two products (amx_tile loads
 * its A for every 32 columns and stores after each 16 x 32). A k-step short of 16 pairs goes through zero-padded
 * scratch, as in amx_tile. Each C tile gets the same instructions on the same operands, in the same order, as
 * amx_tile would give it: the same bits. */
static void amx_block(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int K2,
                      int m, int n) {
    uint16_t as[2][16][32] __attribute__((aligned(64)));
    uint32_t bs[2][16][16] __attribute__((aligned(64)));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int j0 = 0; j0 < K2; j0 += 16) {
        const int kk = K2 - j0 < 16 ? K2 - j0 : 16;
        const uint16_t *ap = a + (int64_t)m * lda + 2 * (int64_t)j0;
        const uint32_t *b0 = bp + (int64_t)j0 * ldb + n;
        if (kk == 16) {
            _tile_loadd(0, ap, lda * 2);
            _tile_loadd(1, ap + 16 * lda, lda * 2);
            _tile_loadd(2, b0, ldb * 4);
            _tile_loadd(3, b0 + 16, ldb * 4);
        } else {
            memset(as, 0, sizeof as);
            memset(bs, 0, sizeof bs);
            for (int r = 0; r < 32; r++) memcpy(as[r / 16][r % 16], ap + (int64_t)r * lda, (size_t)kk * 4);
            for (int j = 0; j < kk; j++) {
                memcpy(bs[0][j], b0 + (int64_t)j * ldb, 64);
                memcpy(bs[1][j], b0 + 16 + (int64_t)j * ldb, 64);
            }
            _tile_loadd(0, as[0], 64);
            _tile_loadd(1, as[1], 64);
            _tile_loadd(2, bs[0], 64);
            _tile_loadd(3, bs[1], 64);
        }
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
    }
    float *cr = c + (int64_t)m * ldc + n;
    _tile_stored(4, cr, ldc * 4);
    _tile_stored(5, cr + 16, ldc * 4);
    _tile_stored(6, cr + 16 * ldc, ldc * 4);
    _tile_stored(7, cr + 16 * ldc + 16, ldc * 4);
}

/* Output columns [n, n + 32) of c: whole 32-row blocks by amx_block, the rows past them by amx_tile. */
static void amx_columns(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M,
                        int N, int K2, int ct) {
    int rt = 0;
    if ((ct + 1) * AMX_GC <= N)
        for (; (rt + 2) * AMX_GR <= M; rt += 2) amx_block(a, lda, bp, ldb, c, ldc, K2, rt * AMX_GR, ct * AMX_GC);
    for (; rt < (M + AMX_GR - 1) / AMX_GR; rt++) amx_tile(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
}

#endif
