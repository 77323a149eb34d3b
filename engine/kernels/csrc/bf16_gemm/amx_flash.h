/* Prefill attention of one work item (a KV head's tile of query rows, prefill/driver.h) on AMX-BF16 tiles, with
 * the softmax online over blocks of 32 keys (FlashAttention's order): the scores of 16 query rows x 32 keys go
 * from two C tiles through L1 into the softmax, their bf16 probabilities into one A tile, and P.V accumulates in
 * four C tiles that hold the rows' first 64 output columns (the rest, for head_dim 128 or 256, add up in L1).
 * Nothing of the rows x keys tile reaches memory: the two-product form (bf16_gemm_serial, masked_softmax_f32,
 * bf16_gemm_serial) stored every score and probability and was store-bound (docs/perf/xeon-amx.md).
 *
 * Arithmetic, per query row r, alone: scores s = q . k in float32 (TDPBF16PS); a reference maximum M_r, raised
 * to a block's maximum only when a score exceeds it by more than FLASH_SLACK (then the output row and the running
 * sum are scaled by exp(M_old - M_new)); p = exp(s - M_r) (exp_less16), summed in float32 into l_r (16 lanes,
 * added up at the end) and rounded to bf16 for P.V; out = (P.V) / l_r. Blocks start at multiples of 32 keys from
 * k_start (the caller aligns k_start to an absolute multiple of 32, prefill/driver.h PREFILL_BF16_ALIGN) and a row
 * skips every block it sees no key of, so a query's bits depend on its own query, keys and values only: not on
 * which rows share its tile or where its chunk starts. Rows past the item's and keys past S are zero-padded through
 * scratch.
 *
 * Order: software-pipelined by one block. The next block's score products are issued before this block's softmax,
 * so the tiles compute while the vector units take the exponentials (the serial order left the tiles idle during the
 * softmax and the softmax waiting for the tiles; same bits). */
#ifndef BATCHGEN_BF16_AMX_FLASH_H
#define BATCHGEN_BF16_AMX_FLASH_H

#include <immintrin.h>
#include <math.h>

#include "../amx.h"
#include "../simd/avx512.h"

#define FLASH_KEYS 32       /* keys per block: one A tile of probabilities (16 pairs) */
#define FLASH_SLACK 8.0f    /* probabilities up to e^8 before the reference maximum moves */

/* Visible keys of query position qpos among block keys [jb, jb + 32) (relative to k_start), as a bit mask. */
static inline uint32_t block_mask(int64_t qpos, int64_t k_start, int64_t window, int64_t jb) {
    int64_t lo = window > 0 ? qpos - window + 1 - k_start : 0, hi = qpos - k_start + 1;   /* [lo, hi) */
    lo = lo > jb ? lo - jb : 0;
    hi = hi < jb + FLASH_KEYS ? hi - jb : FLASH_KEYS;
    if (hi <= lo) return 0;
    const uint32_t upto = hi >= 32 ? 0xffffffffu : ((1u << hi) - 1);
    return upto & ~((1u << lo) - 1);
}

#define FLASH_MAX_D 256
#define FLASH_LO 64         /* output columns held in C tiles 4-7; the rest (ohi) in L1, through tiles 2-3 */

/* the output's columns past FLASH_LO (head_dim > 64): oh[r] = oh[r] + (P.V)[r] for this block, two 16-column
 * tiles at a time through C tiles 2 and 3 (free once the block's scores are stored) */
static inline void flash_pv_hi(const uint32_t *vb, int D, float (*pv)[32], float (*oh)[FLASH_MAX_D - FLASH_LO]) {
    for (int c = FLASH_LO; c < D; c += 32) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(1, vb + c, D * 4);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, vb + c + 16, D * 4);
        _tile_dpbf16ps(3, 0, 1);
        _tile_stored(2, &pv[0][0], 128);
        _tile_stored(3, &pv[0][16], 128);
        for (int r = 0; r < 16; r++)
            for (int x = 0; x < 32; x += 16) {
                float *o = &oh[r][c - FLASH_LO + x];
                _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_load_ps(&pv[r][x])));
            }
    }
}

/* One 16-row tile's state: each row's reference maximum and running sum (16 lanes until the end), a block's scores
 * and probabilities, the output tiles' columns when they pass through memory, the columns past FLASH_LO. */
typedef struct {
    float M[16], scale[16];
    __m512 L[16];
    float sc[2][16][FLASH_KEYS] __attribute__((aligned(64)));   /* this block's scores and the next block's */
    uint16_t pb[16][FLASH_KEYS] __attribute__((aligned(64)));   /* one A tile */
    float ot[16][FLASH_LO] __attribute__((aligned(64)));        /* tiles 4-7 when rescaled or finished */
    float oh[16][FLASH_MAX_D - FLASH_LO] __attribute__((aligned(64)));
    float pv[16][32] __attribute__((aligned(64)));
} flash_tile_t;

static inline void flash_store_lo(flash_tile_t *f) {
    _tile_stored(4, &f->ot[0][0], FLASH_LO * 4);
    _tile_stored(5, &f->ot[0][16], FLASH_LO * 4);
    _tile_stored(6, &f->ot[0][32], FLASH_LO * 4);
    _tile_stored(7, &f->ot[0][48], FLASH_LO * 4);
}

/* Start the block's scores in C tiles 2 and 3: q (16 rows, row stride ldq) . keys kb (pair words, row stride ldkb).
 * Issued before the previous block's softmax, so the tiles compute while the vector units work. */
static inline void flash_scores(const uint16_t *q, int64_t ldq, const uint32_t *kb, int64_t ldkb, int D) {
    _tile_zero(2);
    _tile_zero(3);
    for (int kk = 0; kk < D / 32; kk++) {
        _tile_loadd(0, q + kk * 32, ldq * 2);
        _tile_loadd(1, kb + (int64_t)kk * 16 * ldkb, ldkb * 4);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kb + (int64_t)kk * 16 * ldkb + 16, ldkb * 4);
        _tile_dpbf16ps(3, 0, 1);
    }
}

static inline void flash_scores_store(float (*sc)[FLASH_KEYS]) {
    _tile_stored(2, &sc[0][0], FLASH_KEYS * 4);
    _tile_stored(3, &sc[0][16], FLASH_KEYS * 4);
}

/* The block's probabilities (scores sc) into f->pb, each row against its reference maximum (moved, with
 * f->scale[r] != 1, only when a score passes it by more than the slack: always in a row's first block, everything
 * passes -inf). Row r is query position ts + (r0 + r) / G; `whole`: every row sees every key of the block. Returns
 * whether any row moved. */
static int flash_softmax(flash_tile_t *f, float (*sc)[FLASH_KEYS], int R, int r0, int G, int64_t ts,
                         int64_t k_start, int64_t window, int64_t jb, int whole) {
    int rescale = 0;
    for (int r = 0; r < 16; r++) {
        f->scale[r] = 1.0f;
        const uint32_t vis = whole ? 0xffffffffu : r < R ? block_mask(ts + (r0 + r) / G, k_start, window, jb) : 0;
        if (!vis) {
            _mm512_store_si512(f->pb[r], _mm512_setzero_si512());
            continue;
        }
        const __mmask16 m0 = (__mmask16)vis, m1 = (__mmask16)(vis >> 16);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        const __m512 s0 = _mm512_mask_load_ps(ninf, m0, sc[r]), s1 = _mm512_mask_load_ps(ninf, m1, sc[r] + 16);
        const __m512 bar = _mm512_set1_ps(f->M[r] + FLASH_SLACK);
        if (_mm512_cmp_ps_mask(s0, bar, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, bar, _CMP_GT_OQ)) {
            const float mb = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            if (f->M[r] != -INFINITY) {
                f->scale[r] = _mm512_cvtss_f32(exp16_fast(_mm512_set1_ps(f->M[r] - mb)));
                f->L[r] = _mm512_mul_ps(f->L[r], _mm512_set1_ps(f->scale[r]));
                rescale = 1;
            }
            f->M[r] = mb;
        }
        const __m512 ml = _mm512_set1_ps(f->M[r] * LOG2E_F);
        const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_less16(s0, ml));
        const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_less16(s1, ml));
        f->L[r] = _mm512_add_ps(f->L[r], _mm512_add_ps(p0, p1));
        _mm512_store_si512(f->pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));     /* p0's 16 bf16, then p1's */
    }
    return rescale;
}

/* rows whose maximum moved: their output so far times exp(M_old - M_new) */
static void flash_rescale(flash_tile_t *f, int D) {
    flash_store_lo(f);
    for (int r = 0; r < 16; r++) {
        if (f->scale[r] == 1.0f) continue;
        const __m512 s = _mm512_set1_ps(f->scale[r]);
        for (int d = 0; d < FLASH_LO; d += 16)
            _mm512_store_ps(&f->ot[r][d], _mm512_mul_ps(_mm512_load_ps(&f->ot[r][d]), s));
        for (int d = 0; d < D - FLASH_LO; d += 16)
            _mm512_store_ps(&f->oh[r][d], _mm512_mul_ps(_mm512_load_ps(&f->oh[r][d]), s));
    }
    _tile_loadd(4, &f->ot[0][0], FLASH_LO * 4);
    _tile_loadd(5, &f->ot[0][16], FLASH_LO * 4);
    _tile_loadd(6, &f->ot[0][32], FLASH_LO * 4);
    _tile_loadd(7, &f->ot[0][48], FLASH_LO * 4);
}

/* output += P . V for the block (values vb, pair words, row stride D); C tiles 2 and 3 are free (the next block's
 * scores stored), so the value tiles rotate through 1-3 and a load need not wait for the product before it */
static inline void flash_pv(flash_tile_t *f, const uint32_t *vb, int D) {
    _tile_loadd(0, f->pb, FLASH_KEYS * 2);
    _tile_loadd(1, vb, D * 4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, vb + 16, D * 4);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, vb + 32, D * 4);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, vb + 48, D * 4);
    _tile_dpbf16ps(7, 0, 1);
    if (D > FLASH_LO) flash_pv_hi(vb, D, f->pv, f->oh);
}

/* the keys of block jb (pair words; row stride *ldkb), zero-padded through ks past S */
static inline const uint32_t *flash_keys(const uint32_t *kp, int64_t ldk, int S, int D, int64_t jb,
                                         uint32_t (*ks)[FLASH_KEYS], int64_t *ldkb) {
    *ldkb = ldk;
    if (jb + FLASH_KEYS <= S) return kp + jb;
    memset(ks, 0, sizeof(uint32_t) * (FLASH_MAX_D / 2) * FLASH_KEYS);
    for (int i = 0; i < D / 2; i++) memcpy(ks[i], kp + jb + (int64_t)i * ldk, (size_t)(S - jb) * 4);
    *ldkb = FLASH_KEYS;
    return &ks[0][0];
}

/* the values of block jb (pair words, rows of D words), zero-padded through vs past S */
static inline const uint32_t *flash_values(const uint32_t *vp, int S, int D, int64_t jb,
                                           uint32_t (*vs)[FLASH_MAX_D]) {
    const uint32_t *vb = vp + jb / 2 * D;
    if (jb + FLASH_KEYS <= S) return vb;
    memset(vs, 0, sizeof(uint32_t) * (FLASH_KEYS / 2) * FLASH_MAX_D);
    memcpy(vs, vb, (size_t)((S - jb + 1) / 2) * D * 4);   /* rows of D words: vs read at stride D */
    return &vs[0][0];
}

/* ob[rows, D] (float32) = attention of qt's rows (bf16, row r = token r / G of the item, at query position
 * ts + r / G; rows x D, dense) over KV head keys kp [D/2, ldk] pair words (kp[i][j] = (k[j][2i], k[j][2i+1])) and
 * values vp [S/2, D] pair words, key j at position k_start + j, j < S. D a multiple of 64, at most FLASH_MAX_D. */
static void amx_flash_rows(const uint16_t *qt, int rows, int G, int64_t ts, const uint32_t *kp, int64_t ldk,
                           const uint32_t *vp, int S, int D, int64_t k_start, int64_t window, float *ob) {
    uint16_t qs[16][FLASH_MAX_D] __attribute__((aligned(64)));           /* a last tile's rows, zero-padded */
    uint32_t ks[FLASH_MAX_D / 2][FLASH_KEYS] __attribute__((aligned(64))); /* keys / values past S: zeros */
    uint32_t vs[FLASH_KEYS / 2][FLASH_MAX_D] __attribute__((aligned(64)));
    flash_tile_t f;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int R = rows - r0 < 16 ? rows - r0 : 16;
        const uint16_t *q = qt + (int64_t)r0 * D;
        int64_t ldq = D;
        if (R < 16) {
            memset(qs, 0, sizeof qs);
            for (int r = 0; r < R; r++) memcpy(qs[r], q + (int64_t)r * D, (size_t)D * 2);
            q = &qs[0][0];
            ldq = FLASH_MAX_D;
        }
        int64_t first = INT64_MAX, last = 0;              /* blocks [first, last) that any row sees */
        int64_t all_lo = 0, all_hi = INT64_MAX;           /* keys [all_lo, all_hi) every row sees */
        for (int r = 0; r < 16; r++) {
            f.M[r] = -INFINITY;
            f.L[r] = _mm512_setzero_ps();
            if (r >= R) continue;
            const int64_t qpos = ts + (r0 + r) / G;
            const int64_t lo = window > 0 && qpos - window + 1 > k_start ? qpos - window + 1 - k_start : 0;
            const int64_t hi = qpos - k_start + 1;
            if (lo / FLASH_KEYS * FLASH_KEYS < first) first = lo / FLASH_KEYS * FLASH_KEYS;
            if (hi > last) last = hi;
            if (lo > all_lo) all_lo = lo;
            if (hi < all_hi) all_hi = hi;
        }
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        if (D > FLASH_LO) memset(f.oh, 0, sizeof f.oh);
        /* software-pipelined: the next block's scores run on the tiles during this block's softmax */
        int64_t ldkb;
        int cur = 0;
        const uint32_t *kb = flash_keys(kp, ldk, S, D, first, ks, &ldkb);
        flash_scores(q, ldq, kb, ldkb, D);
        flash_scores_store(f.sc[0]);
        for (int64_t jb = first; jb < last; jb += FLASH_KEYS) {
            const int more = jb + FLASH_KEYS < last;
            if (more) {
                kb = flash_keys(kp, ldk, S, D, jb + FLASH_KEYS, ks, &ldkb);
                flash_scores(q, ldq, kb, ldkb, D);
            }
            const int whole = R == 16 && jb >= all_lo && jb + FLASH_KEYS <= all_hi;   /* every key, every row */
            const int moved = flash_softmax(&f, f.sc[cur], R, r0, G, ts, k_start, window, jb, whole);
            if (more) flash_scores_store(f.sc[cur ^ 1]);
            if (moved) flash_rescale(&f, D);
            flash_pv(&f, flash_values(vp, S, D, jb, vs), D);
            cur ^= 1;
        }
        flash_store_lo(&f);
        for (int r = 0; r < R; r++) {
            const float l = _mm512_reduce_add_ps(f.L[r]);
            const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
            float *o = ob + (int64_t)(r0 + r) * D;
            for (int d = 0; d < FLASH_LO; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_load_ps(&f.ot[r][d]), inv));
            for (int d = FLASH_LO; d < D; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_load_ps(&f.oh[r][d - FLASH_LO]), inv));
        }
    }
}

#endif
