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
 * Work: x's rows in passes of up to AMX_PROMPT_PASS_BYTES, a long K in chunks of AMX_PROMPT_KSTEPS k-steps; bf16 rows
 * with K a multiple of 32 and a stride that is no multiple of 4 KB are the A tiles in place (16 rows at x's stride;
 * against a copy per pass, chunk and thread: 1.02-1.05x, the VM's noise level), other rows are packed as bf16 A tiles
 * (each tile's 1 KB contiguous, a block's k-steps one sequential stream); few rows of a long K take all of K in one
 * chunk. A thread takes whole 32-column pairs; per pair it dequantizes the pair into a panel of B tiles (in a call of
 * one pass of rows, a chunk's k-steps as they come, into its thread's panel: every weight once; with passes of rows,
 * all pairs once, first thing, for all of them, unless that set is large and few passes read it: then each pass as
 * one), prefetching the panel it reads next, then runs every 32-row block of the pass against it: 2 A tiles (16 rows x
 * 16 pairs), 2 B tiles (16 pairs x 16 columns), 4 C tiles, stored between K chunks and loaded back (exact); within a
 * chunk every block runs 8 k-steps before any block runs the next 8 (AMX_PROMPT_SUB: their B tiles stay in L1). Each
 * output's sum runs over K in the same order however the rows and K are cut. Packed bf16 rows: every thread packs its
 * own copy; a block's stores overlap the next block's products (pair_blocks). Measurements: docs/perf/xeon-amx.md. */
#ifndef BATCHGEN_QLINEAR_AMX_PROMPT_H
#define BATCHGEN_QLINEAR_AMX_PROMPT_H

#include <immintrin.h>

#include "../amx.h"

/* A pass packs up to this many bytes of x's rows as bf16 tiles (about half a core's L2, where they stay while every
 * weight pair streams past them; at most AMX_PROMPT_MAX_ROWS rows); a call with more rows runs in passes over weights
 * dequantized once for the whole call. */
#define AMX_PROMPT_PASS_BYTES (1L << 20)
#define AMX_PROMPT_MAX_ROWS 512
/* k-steps (32 columns each) a pass packs at once where K has more than twice as many: a longer K runs in chunks,
 * each block's sums spilled between them, so a pass keeps 512 rows even for a down projection's K of 4,864-8,960
 * (a pass of all of K had 32-96 rows and streamed every dequantized weight from L3 once per pass); a K up to 2,048
 * stays whole (two chunks of 1,536 measured slower than one pass of 320 rows) */
#define AMX_PROMPT_KSTEPS 32
/* A call in passes of rows dequantizes every pair's panel once, first thing, into one set the passes share, where that
 * set is at most this size or more than AMX_PROMPT_SHARED_PASSES passes read it; otherwise each pass dequantizes its
 * own panels as it goes: writing out a 32-64 MB set and reading it back two to four times cost more than the
 * dequantizing it saves (docs/perf/xeon-amx.md, 2026-12-06, twenty-third session). A test build sets it to 0. */
#ifndef AMX_PROMPT_SHARED_BYTES
#define AMX_PROMPT_SHARED_BYTES (24L << 20)
#endif
#define AMX_PROMPT_SHARED_PASSES 4

static void amx_prompt_begin(void) { amx_config_tiles(8); }   /* A0, A1, B0, B1, C00, C01, C10, C11 */

/* the pair's weights (two 16-column blocks of the packed int8 layout, driver.h) as B tiles, each k-step's two tiles
 * side by side (1 KB each, 16 bf16 pairs x 16 columns): panel[(s * 2 + nb) * 256 + r * 16 + c] = (W[col][2j],
 * W[col][2j+1]) for pair-row j = 16 s + r and column col = 16 nb + c, each value bf16(q * scale) */
static void dequant_pair(const int8_t *w, const uint16_t *sw, int Kp, int s0, int sc, uint32_t *panel) {
    const int K4 = Kp / 4, G = Kp / QK;   /* k-steps s0 .. s0 + sc of the pair (8 k4 rows each) */
    for (int nb = 0; nb < 2; nb++)
        for (int k4 = s0 * 8; k4 < (s0 + sc) * 8; k4++) {
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
            uint32_t *dst = panel + ((size_t)(k4 / 8) * 2 + nb) * 256 + (size_t)(2 * k4 % 16) * 16;
            _mm512_store_si512(dst, _mm512_or_si512(h0, _mm512_slli_epi32(h1, 16)));
            _mm512_store_si512(dst + 16, _mm512_or_si512(h2, _mm512_slli_epi32(h3, 16)));
        }
}

/* 16 float32 -> bf16 bits in the low halves of 16 lanes, rounded as f32_to_bf16 (nearest even, subnormals kept,
 * NaN stays NaN) */
static inline __m512i bf16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* exp_clamped, silu and gelu_tanh (common.h) on 16 lanes: the same operations in the same order (the build does not
 * contract a * b + c into FMAs), so the same bits as the scalar forms the unfused GLU runs */
static inline __m512 exp_clamped16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __m512 act16(__m512 g, int act) {
    __m512 z = g;
    if (act != GLU_SILU) {
        const __m512 c = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
        z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f), _mm512_add_ps(g, c));
    }
    const __m512 e = exp_clamped16(_mm512_castsi512_ps(   /* -z: the sign bit flipped (AVX512F: no vxorps) */
        _mm512_xor_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* Where a call's results go: y (row stride ldy) in the form `out` (AMX_OUT_*), GLU-fused or not; `stream`: a
 * plain output whose rows' 32-column pieces are whole 64-byte lines (y and ldy aligned), stored non-temporally. */
typedef struct {
    void *y;
    int ldy, out, glu, stream;
} ydst_t;

/* bytes of one result element in the form `out` */
static inline size_t out_size(int out) { return out == AMX_OUT_F32 ? 4 : 2; }

static ydst_t output_of(void *y, int ldy, int out, int glu) {
    return (ydst_t){y, ldy, out, glu, !glu && ((uintptr_t)y & 63) == 0 && ((size_t)ldy * out_size(out)) % 64 == 0};
}

/* A whole pair's row (32 columns) written past the caches: 128 bytes of float32 or 64 of bf16, whole lines, so the
 * store needs no read of the line first (a prompt's outputs are megabytes, read back by the next layer's kernel
 * from memory either way). The same values as store_row's. */
static inline void stream_row(const float *acc, void *y, int bf16, size_t off) {
    if (!bf16) {
        _mm512_stream_ps((float *)y + off, _mm512_load_ps(acc));
        _mm512_stream_ps((float *)y + off + 16, _mm512_load_ps(acc + 16));
        return;
    }
    const __m256i lo = _mm512_cvtepi32_epi16(bf16_bits(_mm512_load_ps(acc)));
    const __m256i hi = _mm512_cvtepi32_epi16(bf16_bits(_mm512_load_ps(acc + 16)));
    _mm512_stream_si512((__m512i *)((uint16_t *)y + off), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* store_rows for the tiles' results: the GLU's 16 outputs a row on 16 lanes (driver.h's store_glu, same bits), a
 * streamed output's whole pairs by stream_row, everything else as store_rows */
static inline void amx_store_rows(float (*acc)[32], int R, int m, int np, int ncols, const ydst_t *d) {
    void *y = d->y;
    const int ldy = d->ldy, out = d->out, glu = d->glu;
    if (d->stream && ncols == 32) {
        for (int r = 0; r < R; r++) stream_row(acc[r], y, out != AMX_OUT_F32, (size_t)(m + r) * ldy + (size_t)np * 32);
        return;
    }
    if (!glu) {
        store_rows(acc, R, m, np, ncols, y, ldy, out != AMX_OUT_F32, glu);
        return;
    }
    for (int r = 0; r < R; r++) {
        __m512 g = _mm512_load_ps(acc[r]), u = _mm512_load_ps(acc[r] + 16);
        const size_t off = (size_t)(m + r) * ldy + np * 16;
        if (out == AMX_OUT_BF16) {   /* gate and up rounded to bf16 first, as the unfused path's bf16 product */
            g = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(g), 16));
            u = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(u), 16));
        }
        const __m512 o = _mm512_mul_ps(act16(g, glu), u);
        if (out != AMX_OUT_F32)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + off), _mm512_cvtepi32_epi16(bf16_bits(o)));
        else
            _mm512_storeu_ps((float *)y + off, o);
    }
}

/* rows m0 .. m0 + rows of x, k-steps s0 .. s0 + S (32 columns each), as A tiles, each 32-row block's two 16-row
 * tiles of a k-step side by side (1 KB each): xa[((b * S + s) * 2 + h) * 512 + r * 32 + c] =
 * bf16(x[m0 + 32 b + 16 h + r][32 (s0 + s) + c]), zeros past M and K */
static void pack_rows(const void *x, int is_bf16, int M, int K, int ldx, int m0, int rows, int s0, int S,
                      uint16_t *xa, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt) if (rows > 8)
    for (int i = 0; i < rows; i++) {
        const int m = m0 + i;
        uint16_t *dst = xa + ((size_t)(i / 32) * S * 2 + (i % 32) / 16) * 512 + (size_t)(i % 16) * 32;
        for (int s = s0; s < s0 + S; s++, dst += 1024) {
            const int k0 = s * 32, n = m >= M ? 0 : K - k0 < 32 ? K - k0 : 32;
            const __mmask32 mask = n >= 32 ? 0xffffffffu : ((1u << n) - 1);
            __m512i v;
            if (is_bf16) {
                v = _mm512_maskz_loadu_epi16(mask, (const uint16_t *)x + (size_t)m * ldx + k0);
            } else {
                const float *src = (const float *)x + (size_t)m * ldx + k0;
                const __m512i lo = bf16_bits(_mm512_maskz_loadu_ps((__mmask16)mask, src));
                const __m512i hi = bf16_bits(_mm512_maskz_loadu_ps((__mmask16)(mask >> 16), src + 16));
                v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
            }
            _mm512_store_si512(dst, v);
        }
    }
}

/* The output lines a block's rows m .. m + R of pair np will be stored to, asked for with write intent while the
 * block's tile products run: their misses then overlap the products instead of stalling the stores. Only for a
 * plain output's two lines a row that is not streamed (a GLU row's one line measured slower with it:
 * docs/perf/xeon-amx.md). */
static inline void prefetch_out(const ydst_t *d, int R, int m, int np) {
    const size_t esz = out_size(d->out);
    for (int r = 0; r < R; r++) {
        const char *p = (const char *)d->y + ((size_t)(m + r) * d->ldy + (size_t)np * 32) * esz;
        _mm_prefetch(p, _MM_HINT_T0);
        if (esz == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
    }
}

/* A finished block's stores (and GLU), a few rows at a time: rows done .. until of the block whose sums are in acc */
typedef struct {
    float (*acc)[32];
    int m, R, done;   /* the block's first output row, its rows, rows stored so far */
} pending_t;

static inline void store_some(pending_t *p, int until, int np, int ncols, const ydst_t *d) {
    until = until < p->R ? until : p->R;
    if (until > p->done) amx_store_rows(p->acc + p->done, until - p->done, p->m + p->done, np, ncols, d);
    p->done = until > p->done ? until : p->done;
}

/* This thread's copy of a pass's bf16 rows (pack_rows by this thread alone into its slot of xas) */
static const uint16_t *own_rows(const void *x, int M, int K, int ldx, int m0, int rows, int s0, int sc,
                                uint16_t *xas, size_t xa_words) {
    int tid = 0;
#ifdef _OPENMP
    tid = omp_get_thread_num();
#endif
    uint16_t *xa = xas + (size_t)tid * xa_words;
    pack_rows(x, 1, M, K, ldx, m0, rows, s0, sc, xa, 1);
    return xa;
}

/* Where a pass's A tiles are read from: 32-row block b's tile h (0: rows 0-15, 1: rows 16-31) at k-step s of the chunk
 * starts at base + b * block + s * step + h * half, its 16 rows `stride` bytes apart. Packed rows (pack_rows): 1 KB
 * tiles one after another; bf16 x read in place: x's own rows. A pass's last block past M (tail, or NULL) is packed. */
typedef struct {
    const uint16_t *base, *tail;
    size_t block, step, half;
    int stride;
} arows_t;

static arows_t packed_rows(const uint16_t *xa, int sc) {
    return (arows_t){xa, NULL, (size_t)sc * 1024, 1024, 512, 64};
}

/* k-steps of a chunk run over every 32-row block of the pass before the next ones: their B tiles (2 KB a k-step,
 * 16 KB) then stay in L1 while the blocks' A tiles stream from L2, where a whole chunk's panel (56 KB at K = 896) would
 * be read from L2 again for every block; each block's sums wait in `loc` between sub-chunks (a tile stored and
 * loaded back: exact). Measured against the whole-chunk order: docs/perf/xeon-amx.md (2026-12-06). */
#ifndef AMX_PROMPT_SUB
#define AMX_PROMPT_SUB 8
#endif

/* The panel a pair's blocks read after this sub-chunk (the chunk's next k-steps, or after its last sub-chunk the next
 * pair's first: `next`, NULL where it is not dequantized yet), prefetched into L2 a few lines after each k-step while
 * this sub-chunk runs, so the first block of the next sub-chunk does not wait for it (a pass reads each panel from L3
 * or memory once; measured: docs/perf/xeon-amx.md, twenty-third session). */
typedef struct {
    const char *p;
    int lines, per_step, done;
} ahead_t;

static inline ahead_t panel_ahead(const uint32_t *panel, const uint32_t *next, int s0, int u0, int un, int sc, int sub,
                                  int steps) {
    const int rest = sc - u0 - un;                  /* the chunk's k-steps after this sub-chunk */
    const uint32_t *p = rest > 0 ? panel + (size_t)(s0 + u0 + un) * 512 : next ? next + (size_t)s0 * 512 : NULL;
    const int ksteps = rest > 0 ? rest : sc, lines = p ? (ksteps < sub ? ksteps : sub) * 32 : 0;   /* 2 KB a k-step */
    return (ahead_t){(const char *)p, lines, (lines + steps - 1) / steps, 0};
}

static inline void prefetch_ahead(ahead_t *a) {
    for (int i = 0; i < a->per_step && a->done < a->lines; i++, a->done++)
        _mm_prefetch(a->p + (size_t)a->done * 64, _MM_HINT_T1);
}

/* One weight pair's panel against a pass's 32-row blocks over k-steps s0 .. s0 + sc (rows from A), in sub-chunks
 * of AMX_PROMPT_SUB k-steps: each block's 4 C tiles start at zero (`first`) or from `part` (its sums so far, 1,024
 * floats a block), and end in `part` or, after the last chunk, in y (amx_store_rows). In the last sub-chunk of the
 * last chunk a plain block's stores run while the next block's tile products do (a few rows after each k-step, so
 * their cache misses overlap the products), from one of two sums buffers; a GLU block's run at once (interleaved
 * they measured slower). Each output's sum runs over K in the same order, so its bits are the same either way. */
static void pair_blocks(const arows_t *A, const uint32_t *panel, const uint32_t *next, int rows, int s0, int sc,
                        int first, int last, float *part, int M, int m0, int np, int ncols, const ydst_t *d) {
    float acc[2][32][32] __attribute__((aligned(64)));
    float loc[AMX_PROMPT_MAX_ROWS / 32][1024] __attribute__((aligned(64)));   /* sums between sub-chunks */
    pending_t pend = {acc[1], 0, 0, 0};
    const int glu = d->glu;
    const int nblocks = rows / 32, sub = nblocks > 1 ? AMX_PROMPT_SUB : sc;
    for (int u0 = 0; u0 < sc; u0 += sub) {
        const int un = sc - u0 < sub ? sc - u0 : sub, ufirst = u0 == 0, ulast = u0 + un >= sc;
        const int done = ulast && last;                 /* this sub-chunk's blocks end in y */
        const int per_step = (32 + un - 1) / un;        /* rows of the previous block stored after each k-step */
        ahead_t ahead = panel_ahead(panel, next, s0, u0, un, sc, sub, nblocks * un);
        for (int b = 0; b < nblocks; b++) {
            float *sums = part ? part + (size_t)b * 1024 : NULL;    /* K in chunks only */
            const float *from = ufirst ? sums : loc[b];
            const int m = m0 + b * 32, R = M - m < 32 ? M - m : 32;
            if (ufirst && first) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
            } else {
                _tile_loadd(4, from, 64);
                _tile_loadd(5, from + 256, 64);
                _tile_loadd(6, from + 512, 64);
                _tile_loadd(7, from + 768, 64);
            }
            if (done && !glu && !d->stream && R > 0) prefetch_out(d, R, m, np);
            const int tail = A->tail && b == nblocks - 1;
            const arows_t T = tail ? packed_rows(A->tail, sc) : *A;
            const uint16_t *a = tail ? A->tail : A->base + (size_t)b * A->block;
            for (int s = u0; s < u0 + un; s++) {
                _tile_loadd(0, a + (size_t)s * T.step, T.stride);
                _tile_loadd(1, a + (size_t)s * T.step + T.half, T.stride);
                _tile_loadd(2, panel + (size_t)(s0 + s) * 512, 64);
                _tile_loadd(3, panel + (size_t)(s0 + s) * 512 + 256, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
                prefetch_ahead(&ahead);
                if (done) store_some(&pend, (s - u0 + 1) * per_step, np, ncols, d);
            }
            if (!done) {
                float *to = ulast ? sums : loc[b];
                _tile_stored(4, to, 64);
                _tile_stored(5, to + 256, 64);
                _tile_stored(6, to + 512, 64);
                _tile_stored(7, to + 768, 64);
                continue;
            }
            store_some(&pend, 32, np, ncols, d);
            float (*next)[32] = acc[b & 1];
            _tile_stored(4, &next[0][0], 128);
            _tile_stored(5, &next[0][16], 128);
            _tile_stored(6, &next[16][0], 128);
            _tile_stored(7, &next[16][16], 128);
            pend = (pending_t){next, m, R > 0 ? R : 0, 0};
            if (glu) store_some(&pend, 32, np, ncols, d);   /* at once: measured faster for a GLU */
        }
    }
    store_some(&pend, 32, np, ncols, d);
}

/* Whether a call's passes of rows share one set of dequantized panels (set_bytes in all). One pass needs none: each
 * pair's k-steps of a chunk are dequantized into its thread's panel as they come (every weight once). Several share
 * one, every pair's panel dequantized first thing, where that set is small or many passes read it
 * (AMX_PROMPT_SHARED_BYTES); else each pass dequantizes again, as one pass does. */
static inline int panels_shared(int npass, size_t set_bytes) {
    return npass > AMX_PROMPT_SHARED_PASSES || (npass > 1 && set_bytes <= (size_t)AMX_PROMPT_SHARED_BYTES);
}

/* Whether x's rows are the A tiles in place (x's rows as the tiles' rows; a pass's last block past M packed, zeros
 * past M): bf16 rows with K a multiple of 32, unless their stride is a multiple of 4 KB: in place, a pass's rows
 * would fall on the same cache sets (L1's repeat every 4 KB) and evict one another (a 1B model's down projection,
 * K = 8,192: docs/perf/xeon-amx.md). */
static inline int rows_in_place(int is_bf16, int K, int Kp, int ldx) {
    return is_bf16 && K == Kp && (size_t)ldx * 2 % 4096 != 0;
}

/* y[M, N] (row stride ldy, in the form `out`: AMX_OUT_*; GLU-fused as driver.h's store_rows) = bf16(x) @ bf16(W)^T;
 * x [M, K] (float32, or bf16 with is_bf16) at row stride ldx. Returns 0 (nothing written) where the tiles may not
 * run. */
static int amx_prompt_linear(const void *x, int is_bf16, int M, int K, int ldx, const int8_t *w, const uint16_t *sw,
                             int Np, int N, void *y, int ldy, int out, int glu, int nt) {
    if (M <= 0) return 1;
    if (!amx_available()) return 0;
    const int Kp = (K + QK - 1) / QK * QK, K2 = Kp / 2, K4 = Kp / 4, G = Kp / QK, S = Kp / 32, npair = Np / 32;
    const int Mp = (M + 31) / 32 * 32;
    int SC = S <= 2 * AMX_PROMPT_KSTEPS ? S : AMX_PROMPT_KSTEPS;
    long pass_bytes = AMX_PROMPT_PASS_BYTES;
    if (SC < S && (long)Mp * S * 64 <= 2 * AMX_PROMPT_PASS_BYTES) {
        /* few rows of a long K: all of K in one pass of rows, so each pair is dequantized into its thread's panel
         * as it comes, rather than every pair's panel stored first (N x K x 2 bytes: 100 MB for a 4B model's
         * gate_up, allocated and written out every call: 43 ms at 64 rows against 16 for the int8 dot products) */
        SC = S;
        pass_bytes = 2 * AMX_PROMPT_PASS_BYTES;
    }
    const int nk = (S + SC - 1) / SC;
    int cap = (int)(pass_bytes / ((long)SC * 64)) / 32 * 32;
    cap = cap < 32 ? 32 : cap > AMX_PROMPT_MAX_ROWS ? AMX_PROMPT_MAX_ROWS : cap;
    const int pass_rows = Mp < cap ? Mp : cap;
    const size_t panel_words = (size_t)K2 * 32;
    const int shared = panels_shared((Mp + pass_rows - 1) / pass_rows, (size_t)npair * panel_words * 4);
    uint32_t *panels = shared ? (uint32_t *)aligned_alloc(64, (size_t)npair * panel_words * 4) : NULL;
    /* K in chunks: each 32 x 32 block's partial sums between chunks (a tile stored and loaded back: exact) */
    float *spill = nk > 1 ? (float *)aligned_alloc(64, (size_t)npair * pass_rows * 32 * 4) : NULL;
    /* rows not read in place: bf16 ones packed by every thread into its own copy, then read from its own L2 instead
     * of half of them from the other core's; float32 ones packed once, by all threads (converting twice measured
     * slower) */
    const int direct = rows_in_place(is_bf16, K, Kp, ldx), copies = direct ? 0 : is_bf16 ? nt : 1;
    const size_t xa_words = (size_t)pass_rows * SC * 32;
    uint16_t *xas = copies ? (uint16_t *)aligned_alloc(64, (size_t)copies * xa_words * 2) : NULL;
    uint16_t *xt = direct && M % 32 ? (uint16_t *)aligned_alloc(64, (size_t)SC * 1024 * 2) : NULL;
    const ydst_t dst = output_of(y, ldy, out, glu);
    for (int m0 = 0; m0 < Mp; m0 += pass_rows) {
        const int rows = Mp - m0 < pass_rows ? Mp - m0 : pass_rows;
        for (int kc = 0; kc < nk; kc++) {
            const int s0 = kc * SC, sc = S - s0 < SC ? S - s0 : SC, last = kc == nk - 1;
            arows_t rows_of = packed_rows(xas, sc);
            if (direct) {
                const int tail = xt && m0 + rows > M;
                if (tail) pack_rows(x, 1, M, K, ldx, m0 + rows - 32, 32, s0, sc, xt, 1);
                rows_of = (arows_t){(const uint16_t *)x + (size_t)m0 * ldx + (size_t)s0 * 32, tail ? xt : NULL,
                                    (size_t)32 * ldx, 32, (size_t)16 * ldx, ldx * 2};
            } else if (copies == 1) {
                pack_rows(x, is_bf16, M, K, ldx, m0, rows, s0, sc, xas, nt);
            }
#pragma omp parallel num_threads(nt)
            {
                const arows_t A = copies > 1 ? packed_rows(own_rows(x, M, K, ldx, m0, rows, s0, sc, xas, xa_words), sc)
                                             : rows_of;
                uint32_t *own = panels ? NULL : (uint32_t *)aligned_alloc(64, panel_words * 4);
                amx_prompt_begin();
#pragma omp for schedule(static)
                for (int np = 0; np < npair; np++) {
                    uint32_t *panel = panels ? panels + (size_t)np * panel_words : own;
                    if (!panels)
                        dequant_pair(w + (size_t)np * 2 * K4 * 64, sw + (size_t)np * 2 * G * 16, Kp, s0, sc, panel);
                    else if (m0 == 0 && kc == 0)
                        dequant_pair(w + (size_t)np * 2 * K4 * 64, sw + (size_t)np * 2 * G * 16, Kp, 0, S, panel);
                    const int ncols = N - np * 32 < 32 ? N - np * 32 : 32;
                    const uint32_t *next = panels && (m0 > 0 || kc > 0) && np + 1 < npair ? panel + panel_words : NULL;
                    pair_blocks(&A, panel, next, rows, s0, sc, kc == 0, last,
                                spill ? spill + (size_t)np * (rows / 32) * 1024 : NULL, M, m0, np, ncols, &dst);
                }
                if (dst.stream) _mm_sfence();   /* this thread's streamed rows visible before the region ends */
                _tile_release();
                free(own);
            }
        }
    }
    free(xt);
    free(xas);
    free(panels);
    free(spill);
    return 1;
}

#endif
