/* bf16_gemm (bf16_gemm.h) over an implementation's output tiles: the loops every implementation shares. An
 * implementation file defines GR and GC (rows and columns per tile), includes this header, then defines tiles()
 * (declared below). */
#ifndef BATCHGEN_BF16_GEMM_DRIVER_H
#define BATCHGEN_BF16_GEMM_DRIVER_H

#include <stdint.h>

#include "../kernels.h"
#include "bf16_gemm.h"

/* Output tile (rt, ct) (GR rows x GC columns, fewer at the edges) of c = a @ b. Each implementation inlines it
 * into both callers: as a plain static function GCC kept it out of line and the whole matmul ran 2.7x slower
 * (measured). */
#ifdef HAVE_AMX_TILES
/* this process's choice, made once when the library loads (bf16_gemm_amx): tiles or the vector micro-kernel */
static int amx_on = 0;
#endif

static void tiles(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M,
                  int N, int K2, int rt, int ct);

void bf16_gemm_serial(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc,
                      int M, int N, int K2) {
#ifdef HAVE_AMX_TILES
    if (amx_on) {
        amx_begin();
        for (int ct = 0; ct < (N + AMX_GC - 1) / AMX_GC; ct++) amx_columns(a, lda, bp, ldb, c, ldc, M, N, K2, ct);
        _tile_release();
        return;
    }
#endif
    for (int ct = 0; ct < (N + GC - 1) / GC; ct++)
        for (int rt = 0; rt < (M + GR - 1) / GR; rt++) tiles(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
}

int bf16_gemm_tiles_on(void) {
#ifdef HAVE_AMX_TILES
    return amx_on;
#else
    return 0;
#endif
}

int prefill_online_softmax(int head_dim) {
#ifdef HAVE_AMX_TILES
    return amx_on && head_dim % 64 == 0 && head_dim <= FLASH_MAX_D;
#else
    (void)head_dim;
    return 0;
#endif
}

int bf16_attention_amx(const uint16_t *qt, int rows, int G, int64_t ts, const uint32_t *kp, int64_t ldk,
                       const uint32_t *vp, int S, int D, int64_t k_start, int64_t window, float *ob) {
#ifdef HAVE_AMX_TILES
    if (prefill_online_softmax(D)) {
        amx_begin();
        amx_flash_rows(qt, rows, G, ts, kp, ldk, vp, S, D, k_start, window, ob);
        _tile_release();
        return 1;
    }
#endif
    (void)qt, (void)rows, (void)G, (void)ts, (void)kp, (void)ldk, (void)vp, (void)S, (void)D, (void)k_start;
    (void)window, (void)ob;
    return 0;
}

int bf16_gemm_amx(int enable) {
#ifdef HAVE_AMX_TILES
    amx_on = enable && amx_available();
    return amx_on;
#else
    (void)enable;
    return 0;
#endif
}

void bf16_gemm(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, float *c, int64_t ldc, int M,
               int N, int K2, int nt) {
    (void)nt;
#ifdef HAVE_AMX_TILES
    if (amx_on) {
        const int amx_rows = (M + AMX_GR - 1) / AMX_GR, amx_cols = (N + AMX_GC - 1) / AMX_GC;
#pragma omp parallel num_threads(nt) if ((int64_t)M * N * K2 > 65536)
        {
            amx_begin();
#pragma omp for collapse(2) schedule(static)
            for (int ct = 0; ct < amx_cols; ct++)
                for (int rt = 0; rt < amx_rows; rt++) amx_tile(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
            _tile_release();
        }
        return;
    }
#endif
    const int row_tiles = (M + GR - 1) / GR, col_tiles = (N + GC - 1) / GC;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt) if ((int64_t)M * N * K2 > 65536)
    for (int ct = 0; ct < col_tiles; ct++)
        for (int rt = 0; rt < row_tiles; rt++) tiles(a, lda, bp, ldb, c, ldc, M, N, K2, rt, ct);
}

#endif
