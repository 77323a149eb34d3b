/* Decode attention for the CPU.
 *
 * paged_decode_{bf16,f32}: decode attention, one query token per sequence, keys/values read in place from
 * the paged KV cache (no gather copy), online softmax in float32 (the prefill tile's softmax is masked_softmax.c).
 *
 * Why: the torch path gathers every decode sequence's visible blocks into a contiguous copy, then runs two
 * batched matmuls with M = heads-per-KV-head (4 for gemma-3): the KV bytes move three times at a poor rate.
 * Decode attention is memory-bound, so reading each visible key and value once is what matters.
 *
 * Layouts (all contiguous, row-major):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_stride] int32 (physical block of each logical block)
 *   seq_lens      [num_seqs] int32: keys at positions [lo, seq_len) are visible, lo = max(0, seq_len - window)
 *                 when window > 0, else 0.
 * The query heads h*G .. h*G+G-1 share KV head h (G = num_heads / num_kv_heads).
 *
 * Work item = (group of sequences, KV head); items run in parallel (OpenMP). Sequences are sorted by their
 * block tables and cut into groups that start on the same block (a shared prompt prefix), a few per thread.
 * Each sequence walks its visible blocks in order: scores for the block's tokens, an online-softmax update,
 * then the weighted sum of the block's values; blocks shared by a whole group are walked once for all of its
 * members, so they come from memory once (group_item); on AMX tiles the members' query rows are stacked side by
 * side in each score tile's and softmax vector's 16 lanes (16 // G members, at most MAX_STACK), so one tile product
 * and one softmax pass serve them all (and, from 6 rows per KV head, one P.V on the tiles). A sequence's result
 * never depends on its group. With a vector
 * implementation (avx2.c, avx512.c: vec.h's pieces; avx512_bf16.c: bf16 scores and P.V with AVX512-BF16 dot
 * products, vec.h's for float32 caches), head_dim a multiple of 32 and G from 1 to 8 (Qwen2.5's 7 and 6 too),
 * both bf16 and float32 caches take the vector path; everything else takes the portable loops below, which are also the reference
 * (portable.c: nothing else).
 *
 * This header is what the implementations share. An implementation file defines, then includes this header:
 *   FAST_PATH   1 where it has vector pieces (then its simd/ header comes first: VEC_WIDTH), else 0
 *   PAIRED_PV   1 where its P.V over bf16 and int8 caches leaves acc in a permuted column order (finish_paired)
 *   I8_IN_DOT   1 where int8 rows go straight into its dot products; 0: they are widened into a float32 tile
 *   AMX_SCORES  1 where a bf16 cache's scores may run on AMX tiles (K rows as they lie in the cache are the A
 *               operand, the query the B: scores^T of a 16-token block in one C tile, AMX_RUN blocks at a time so
 *               their products overlap), else 0 (the default)
 * and after it defines the functions declared below under "each implementation defines" (FAST_PATH and PAIRED_PV
 * say which).
 */
#ifndef BATCHGEN_PAGED_DECODE_DRIVER_H
#define BATCHGEN_PAGED_DECODE_DRIVER_H

#include <stdlib.h>

#include "../common.h"
#include "../kernels.h"

/* The cache's element kind. KV_I8 (kv_cache_dtype: int8): a block is its bs x Hkv rows of D int8 (D a multiple of
 * 32), then their float32 scales, one per row and group of 32 (value = quant * scale; engine/quant/int8_kv.py),
 * so rows stay 64-byte aligned. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };

#ifndef AMX_SCORES
#define AMX_SCORES 0   /* an implementation with AMX-BF16 sets it: a bf16 cache's scores on tiles (its hooks below) */
#endif
#define AMX_RUN 4      /* blocks whose scores one amx_run_scores computes: four independent C tiles in flight */

#define MAX_GROUP 64
#define MAX_BLOCK 256
#define MAX_MEMBERS 16   /* sequences per work item (see the entry points) */

/* Software prefetch of n rows of `bytes` each (row stride in bytes), one per cache line, into L2 (prefetcht2): a
 * block's 16 KB of keys and values issued into L1 at once (prefetcht0) evicted the block being read (L2 as the
 * target measured faster: docs/perf/code-notes-kernels.md). */
static inline void prefetch_rows(const char *p, int64_t stride, int32_t n, int32_t bytes) {
    for (int32_t j = 0; j < n; j++)
        for (int32_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + j * stride + o, 0, 1);
}

/* Block b of a sequence whose visible keys are [lo, seq_len): *n visible rows starting at the returned element
 * offset (KV head h) in the cache, the first at slot *slot of its block; blocks are bstride elements apart. */
static inline int64_t block_rows(const int32_t *table, int32_t b, int32_t lo, int32_t seq_len, int32_t bs,
                                 int64_t tok_stride, int64_t bstride, int32_t h, int32_t D, int32_t *n,
                                 int32_t *slot) {
    const int32_t t0 = b * bs > lo ? b * bs : lo;
    const int32_t t1 = (b + 1) * bs < seq_len ? (b + 1) * bs : seq_len;
    *n = t1 - t0;
    *slot = t0 - b * bs;
    return (int64_t)table[b] * bstride + (int64_t)*slot * tok_stride + (int64_t)h * D;
}


/* ---- portable tile pieces (float32 tiles) ------------------------------------------------------------- */

/* n rows of D (row stride in elements) from a bf16, float32 or int8 cache into a dense float32 tile (int8: each
 * group of 32 times its scale, row j's at sc + j * sc_stride). */
static void widen(const void *src, int64_t stride, int32_t n, int32_t D, float *dst, const int kind,
                  const float *sc, int64_t sc_stride) {
    for (int32_t j = 0; j < n; j++) {
        if (kind == KV_I8) {
            const int8_t *r = (const int8_t *)src + j * stride;
            const float *f = sc + j * sc_stride;
            for (int32_t d = 0; d < D; d++) dst[(int64_t)j * D + d] = (float)r[d] * f[d / I8_GROUP];
        } else if (kind == KV_BF16) {
            const uint16_t *r = (const uint16_t *)src + j * stride;
            uint32_t *o = (uint32_t *)(dst + (int64_t)j * D);
            for (int32_t d = 0; d < D; d++) o[d] = (uint32_t)r[d] << 16;
        } else {
            memcpy(dst + (int64_t)j * D, (const float *)src + j * stride, sizeof(float) * D);
        }
    }
}

/* s[g*ld + j] = q[g] . k[j]; q [G, D], k [n, D] dense float32. */
static void tile_scores(const float *q, const float *k, int32_t G, int32_t n, int32_t D, float *s, int32_t ld) {
    for (int32_t g = 0; g < G; g++) {
        for (int32_t j = 0; j < n; j++) {
            const float *qg = q + (int64_t)g * D, *kj = k + (int64_t)j * D;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int32_t d = 0; d < D; d++) dot += qg[d] * kj[d];
            s[g * ld + j] = dot;
        }
    }
}

/* acc[g] += sum_j p[g*ld + j] * v[j]; v [n, D] dense float32. */
static void tile_accumulate(float *acc, const float *p, const float *v, int32_t G, int32_t n, int32_t D,
                            int32_t ld) {
    for (int32_t g = 0; g < G; g++) {
        float *ag = acc + (int64_t)g * D;
        for (int32_t j = 0; j < n; j++) {
            const float pj = p[g * ld + j];
            const float *vj = v + (int64_t)j * D;
#pragma omp simd
            for (int32_t d = 0; d < D; d++) ag[d] += pj * vj[d];
        }
    }
}


/* Online softmax over one block: s[g, :n] becomes exp(s - new max); acc, l, m are rescaled. */
static void softmax_update(float *s, int32_t ld, int32_t n, int32_t G, int32_t D, float *m, float *l, float *acc) {
    for (int32_t g = 0; g < G; g++) {
        float *sg = s + g * ld;
        float bmax = m[g];
#pragma omp simd reduction(max:bmax)     /* max is exact: any order gives the same value (vectorized) */
        for (int32_t j = 0; j < n; j++) bmax = sg[j] > bmax ? sg[j] : bmax;
        /* an unchanged maximum (most blocks after the first few) skips the libm call: expf(0) is exactly 1 */
        const float corr = m[g] == -INFINITY ? 0.0f : (m[g] == bmax ? 1.0f : expf(m[g] - bmax));
        if (corr != 1.0f) {
            for (int32_t d = 0; d < D; d++) acc[(int64_t)g * D + d] *= corr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int32_t j = 0; j < n; j++) {
            sg[j] = exp_clamped(sg[j] - bmax);
            sum += sg[j];
        }
        l[g] = l[g] * corr + sum;
        m[g] = bmax;
    }
}

/* G (the query heads per KV head) as a compile-time constant G_ in CALL: the fast pieces keep G accumulators in
 * registers */
#define DISPATCH_G(G, CALL)                                         \
    switch (G) {                                                    \
        case 1: { const int G_ = 1; CALL; } break;                  \
        case 2: { const int G_ = 2; CALL; } break;                  \
        case 3: { const int G_ = 3; CALL; } break;                  \
        case 4: { const int G_ = 4; CALL; } break;                  \
        case 5: { const int G_ = 5; CALL; } break;                  \
        case 6: { const int G_ = 6; CALL; } break;                  \
        case 7: { const int G_ = 7; CALL; } break;                  \
        default: { const int G_ = 8; CALL; } break;                 \
    }

#if FAST_PATH
/* head_dim a multiple of this takes the fast pieces: column chunks of two vectors for P.V; the AVX512-BF16 score
 * and P.V paths work in 32-column chunks too */
#define FAST_D_MULTIPLE (2 * VEC_WIDTH > 32 ? 2 * VEC_WIDTH : 32)
#else
#define FAST_D_MULTIPLE 1
#endif

/* ---- one sequence's G query rows of one KV head: state, one block, the result --------------------------- */

typedef struct {
    float *qf, *acc, *m, *l;       /* q * scale [G*D]; running P.V [G*D]; running max and sum [G] */
    uint16_t *qb;                  /* q * scale in bf16 [G*D]: the AVX512-BF16 scores only */
    uint32_t *qt;                  /* qb as AMX B tiles ([D/32][16 pairs][16 rows g]), or NULL (AMX_SCORES only) */
    const int32_t *table;
    int32_t seq_len, lo;           /* visible keys [lo, seq_len) */
} rows_t;

/* ---- each implementation defines ------------------------------------------------------------------------ */

#if FAST_PATH
/* s[g*ld + j] = q[g] . k_j for n tokens of one block (row stride `stride`, in elements; qf the scaled query in
 * float32, qb in bf16; an int8 cache's scales at sc, sc_stride floats per token). G and kind are compile-time
 * constants at every call site (always_inline + DISPATCH_G), so the accumulators live in registers. */
static void fast_scores(const int G, const int kind, const float *qf, const uint16_t *qb, const void *k,
                        int64_t stride, int32_t n, int32_t D, float *s, int32_t ld, const float *sc,
                        int64_t sc_stride);
/* acc[g] += sum_j p[g*ld + j] * v_j for the block's n tokens (G and kind constant, as for fast_scores). */
static void fast_accumulate(const int G, const int kind, float *acc, const float *p, int32_t ld, const void *v,
                            int64_t stride, int32_t n, int32_t D, const float *sc, int64_t sc_stride);
#endif
#if AMX_SCORES
/* 1 where a bf16 cache's scores take the tiles here (they are on: bf16_gemm_tiles_on) for this G, D and bs */
static int amx_scores_ok(int32_t G, int32_t D, int32_t bs);
static void amx_query_tiles(const uint16_t *qb, int32_t G, int32_t D, uint32_t *qt);   /* r->qt from r->qb */
/* `members` consecutive members' query tiles side by side (members * G <= 16): columns i*G .. i*G+G-1 rs[i]'s
 * rows, the rest zero */
static void amx_stack_tiles(const rows_t *rs, int32_t members, int32_t G, int32_t D, uint32_t *qt);
/* s + i * 256 [j * 16 + g] = q[g] . k_j (scores^T, rows g >= G zero) for the tokens of blocks b0 .. b0 + nb - 1
 * (nb <= AMX_RUN) of one sequence, as block_rows gives them (`kc` the bf16 cache, `scratch` [AMX_RUN][16][D];
 * s 64-byte aligned) */
static void amx_run_scores(const rows_t *r, int32_t b0, int32_t nb, const uint16_t *kc, int32_t bs,
                           int64_t tok_stride, int32_t h, int32_t D, float *s, uint16_t *scratch);
static void amx_scores_begin(void);
static void amx_scores_end(void);
/* the online-softmax update and P.V of one block from its scores^T st [n][16] (lanes: the G query rows, so no
 * row needs a horizontal reduction), the values' pairs as fast_accumulate's (acc left in its paired order);
 * `members` (1 to MAX_STACK) consecutive sequences whose rows sit side by side in the lanes (rs[i]'s at lanes
 * i*G ..), each lane's arithmetic its own, so a member's bits are those of its rows alone */
static void amx_softmax_accumulate(rows_t *rs, int32_t members, const float *st, int32_t n, int32_t G, int32_t D,
                                   const uint16_t *v, int64_t stride);
#endif
#if PAIRED_PV
/* out (q0 on, G rows of D) = acc / l with acc in the paired column order that fast_accumulate leaves for bf16 and
 * int8 caches */
static void finish_paired(const rows_t *r, void *out, int64_t q0, int32_t G, int32_t D, const int is_bf16);
#endif

static inline __attribute__((always_inline)) void rows_init(rows_t *r, const void *q, int64_t q0, int32_t G,
                                                            int32_t D, float scale, const int is_bf16) {
    for (int32_t i = 0; i < G * D; i++) {
        r->qf[i] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[q0 + i]) : ((const float *)q)[q0 + i]) * scale;
        r->qb[i] = f32_to_bf16(r->qf[i]);
        r->acc[i] = 0.0f;
    }
    for (int32_t g = 0; g < G; g++) { r->m[g] = -INFINITY; r->l[g] = 0.0f; }
}

/* Block b of one sequence: scores, online-softmax update, P.V. `prefetch`: also fetch the next block's rows
 * (only the first sequence of a shared block asks; the others find it in cache). s [G*bs] and tile [bs*D] are
 * scratch; `ready`: s already holds the block's scores (amx_run_scores). */
static inline __attribute__((always_inline)) void rows_visit(
        rows_t *r, int32_t b, const char *kc, const char *vc, int32_t G, int32_t D, int32_t bs, int64_t tok_stride,
        int32_t h, int fast, int prefetch, float *s, float *tile, const int kind, const int ready, int32_t members) {
    (void)members;
    const int32_t esize = kind == KV_BF16 ? 2 : (kind == KV_I8 ? 1 : 4);
    const int64_t hkv = tok_stride / D;
    /* elements (bytes, for int8) per block: an int8 block ends with its bs x Hkv float32 scales */
    const int64_t ng = D / I8_GROUP, sc_bytes = 4 * (int64_t)bs * hkv * ng;   /* int8: scales per row, per block */
    const int64_t bstride = bs * tok_stride + (kind == KV_I8 ? sc_bytes : 0);
    int32_t n, slot;
    const int64_t base = block_rows(r->table, b, r->lo, r->seq_len, bs, tok_stride, bstride, h, D, &n, &slot);
    /* the next block's keys now and its values after the scores: hides the scattered-block latency */
    const int pf = prefetch && b + 1 < (r->seq_len + bs - 1) / bs;
    const int64_t next = pf ? (int64_t)r->table[b + 1] * bstride + (int64_t)h * D : 0;
    if (pf) {
        prefetch_rows(kc + next * esize, tok_stride * esize, bs, D * esize);
        if (kind == KV_I8) prefetch_rows(kc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
    }
    const void *kb = kc + base * esize, *vb = vc + base * esize;
    /* int8: the first visible row's scales (D / 32 per row; the next token's Hkv * D / 32 floats on) */
    const int64_t sc_off = base - (int64_t)slot * tok_stride - (int64_t)h * D + bs * tok_stride
                           + 4 * ((int64_t)slot * hkv + h) * ng;
    const float *ksc = kind == KV_I8 ? (const float *)(kc + sc_off) : NULL;
    const float *vsc = kind == KV_I8 ? (const float *)(vc + sc_off) : NULL;
    const int64_t sc_stride = hkv * ng;
    if (fast && !(kind == KV_I8 && !I8_IN_DOT)) {      /* an int8 cache: its rows into the dot products */
#if FAST_PATH
        if (!ready)
            DISPATCH_G(G, fast_scores(G_, kind, r->qf, r->qb, kb, tok_stride, n, D, s, bs, ksc, sc_stride));
        if (pf) {
            prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
            if (kind == KV_I8) prefetch_rows(vc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
        }
#if AMX_SCORES
        if (ready) {
            amx_softmax_accumulate(r, members, s, n, G, D, (const uint16_t *)vb, tok_stride);
            return;
        }
#endif
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        DISPATCH_G(G, fast_accumulate(G_, kind, r->acc, s, bs, vb, tok_stride, n, D, vsc, sc_stride));
#endif
    } else if (fast) {                                  /* an int8 cache widened into the float32 tile */
#if FAST_PATH
        widen(kb, tok_stride, n, D, tile, kind, ksc, sc_stride);
        DISPATCH_G(G, fast_scores(G_, KV_F32, r->qf, r->qb, tile, D, n, D, s, bs, NULL, 0));
        if (pf) {
            prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
            prefetch_rows(vc + next - h * D + bs * tok_stride, 0, 1, (int32_t)sc_bytes);
        }
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        widen(vb, tok_stride, n, D, tile, kind, vsc, sc_stride);
        DISPATCH_G(G, fast_accumulate(G_, KV_F32, r->acc, s, bs, tile, D, n, D, NULL, 0));
#endif
    } else {
        if (pf) prefetch_rows(vc + next * esize, tok_stride * esize, bs, D * esize);
        widen(kb, tok_stride, n, D, tile, kind, ksc, sc_stride);
        tile_scores(r->qf, tile, G, n, D, s, bs);
        softmax_update(s, bs, n, G, D, r->m, r->l, r->acc);
        widen(vb, tok_stride, n, D, tile, kind, vsc, sc_stride);
        tile_accumulate(r->acc, s, tile, G, n, D, bs);
    }
}

static inline __attribute__((always_inline)) void rows_finish(const rows_t *r, void *out, int64_t q0, int32_t G,
                                                              int32_t D, int permuted, const int is_bf16) {
#if PAIRED_PV
    if (permuted) {
        finish_paired(r, out, q0, G, D, is_bf16);
        return;
    }
#else
    (void)permuted;
#endif
    for (int32_t g = 0; g < G; g++) {
        const float inv = r->l[g] > 0.0f ? 1.0f / r->l[g] : 0.0f;
        for (int32_t d = 0; d < D; d++) {
            const float x = r->acc[g * D + d] * inv;
            if (is_bf16) ((uint16_t *)out)[q0 + g * D + d] = f32_to_bf16(x);
            else ((float *)out)[q0 + g * D + d] = x;
        }
    }
}

/* What a work item's block visits share; `tiles`: a bf16 cache's scores on AMX tiles (AMX_SCORES), a sequence's
 * blocks then visited in runs of AMX_RUN with their scores computed together first (each block's by the same tile
 * instructions however the runs fall: a sequence's bits never depend on its group). */
typedef struct {
    const char *kc, *vc;
    int64_t tok_stride;
    int32_t G, D, bs, h;
    int fast, tiles;
    float *s, *tile;              /* rows_visit's scratch */
    float *srun;                  /* tiles: AMX_RUN blocks' scores^T, 256 floats each */
    uint16_t *kscratch;           /* tiles: partial blocks' key rows, zero-padded */
    uint32_t *qt;                 /* tiles: every member's query tiles */
} item_t;

/* it->tiles and its buffers for `count` members (and the tile configuration), where AMX_SCORES may run */
static inline void item_tiles_open(item_t *it, int32_t count, const int kind) {
    it->tiles = 0;
    it->srun = NULL;
    it->kscratch = NULL;
    it->qt = NULL;
#if AMX_SCORES
    it->tiles = it->fast && kind == KV_BF16 && amx_scores_ok(it->G, it->D, it->bs);
    if (!it->tiles) return;
    /* every member's query tiles, then (item_stack) every stack's */
    it->qt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (count + count / 2) * (it->D / 2) * 16);
    it->kscratch = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * AMX_RUN * 16 * it->D);
    it->srun = (float *)aligned_alloc(64, sizeof(float) * AMX_RUN * 256);
    amx_scores_begin();
#else
    (void)count, (void)kind;
#endif
}

/* members whose rows share each tile's lanes on their shared blocks: as many as fit 16 lanes, at most MAX_STACK,
 * where the tiles are on; else 1 */
#define MAX_STACK 4
static inline int32_t item_stack(const item_t *it) {
    const int32_t k = it->tiles ? 16 / it->G : 1;
    return k > MAX_STACK ? MAX_STACK : k;
}

static inline void item_tiles_close(item_t *it) {
#if AMX_SCORES
    if (it->tiles) amx_scores_end();
#endif
    free(it->qt);
    free(it->kscratch);
    free(it->srun);
}

/* blocks [from, to) of one member, in order (in runs where the tiles are on); with `members` > 1 (item_stack:
 * r and the members after it, blocks all see whole and share) their rows together: scores from `stack_qt`
 * (amx_stack_tiles), one softmax pass over every member's lanes */
static inline __attribute__((always_inline)) void visit_blocks(rows_t *r, int32_t from, int32_t to, int prefetch,
                                                               const item_t *it, const int kind, int32_t members,
                                                               const uint32_t *stack_qt) {
    const int32_t run = it->tiles ? AMX_RUN : 1;
#if AMX_SCORES
    rows_t scored = *r;           /* the rows whose scores the run computes: r's, or the stack's */
    if (members > 1) scored.qt = (uint32_t *)stack_qt;
#else
    (void)stack_qt;
#endif
    for (int32_t b = from; b < to; b += run) {
        const int32_t nb = to - b < run ? to - b : run;
#if AMX_SCORES
        if (it->tiles)
            amx_run_scores(&scored, b, nb, (const uint16_t *)it->kc, it->bs, it->tok_stride, it->h, it->D, it->srun,
                           it->kscratch);
#endif
        for (int32_t i = 0; i < nb; i++)
            rows_visit(r, b + i, it->kc, it->vc, it->G, it->D, it->bs, it->tok_stride, it->h, it->fast, prefetch,
                       it->tiles ? it->srun + i * 256 : it->s, it->tile, kind, it->tiles, members);
    }
}

/* ---- one work item: a group of sequences (sharing leading blocks, or one alone) x one KV head ----------- *
 *
 * Sequences that share a prompt prefix share its physical blocks. Visiting them sequence by sequence reads
 * each shared block from memory once per sequence; here the blocks every member sees whole are visited block
 * by block, each member in turn, so a shared block comes from memory once and from cache for the others.
 * Every member still visits its own blocks in increasing order with its own state and the same arithmetic, so
 * its result is bit-identical to computing it alone:
 *
 *     member i:  [first_i .. j0)  alone      (window start: partly visible, or not shared by all)
 *                [j0 .. j1)       together   (shared by every member, wholly visible to each)
 *                [j1 .. end_i)    alone      (its own blocks)
 */
static inline __attribute__((always_inline)) void group_item(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t table_stride,
        const int32_t *seq_lens, const int32_t *members, int32_t count, int32_t num_heads, int32_t num_kv_heads,
        int32_t G, int32_t D, int32_t bs, int32_t window, float scale, int32_t h, void *out, const int kind,
        const int io_bf16) {
    float s[G * bs], tile[bs * D];
    const size_t per = (size_t)G * D;
    float *fbuf = (float *)malloc(sizeof(float) * count * (2 * per + 2 * G));
    uint16_t *hbuf = (uint16_t *)malloc(sizeof(uint16_t) * count * per);
    rows_t rows[MAX_MEMBERS];
    item_t it = {(const char *)k_cache, (const char *)v_cache, (int64_t)num_kv_heads * D, G, D, bs, h,
                 FAST_PATH && D % FAST_D_MULTIPLE == 0 && G >= 1 && G <= 8, 0, s, tile, NULL, NULL, NULL};
    item_tiles_open(&it, count, kind);
    int32_t j0 = 0, j1 = INT32_MAX;
    for (int32_t c = 0; c < count; c++) {
        const int32_t i = members[c], len = seq_lens[i];
        rows_t *r = &rows[c];
        r->qf = fbuf + c * (2 * per + 2 * G);
        r->acc = r->qf + per;
        r->m = r->acc + per;
        r->l = r->m + G;
        r->qb = hbuf + c * per;
        r->table = block_tables + i * table_stride;
        r->seq_len = len;
        r->lo = (window > 0 && len > window) ? len - window : 0;
        rows_init(r, q, ((int64_t)i * num_heads + (int64_t)h * G) * D, G, D, scale, io_bf16);
        r->qt = it.tiles ? it.qt + (size_t)c * (D / 2) * 16 : NULL;
#if AMX_SCORES
        if (r->qt) amx_query_tiles(r->qb, G, D, r->qt);
#endif
        const int32_t first_whole = (r->lo + bs - 1) / bs, last_whole = len / bs;
        j0 = first_whole > j0 ? first_whole : j0;
        j1 = last_whole < j1 ? last_whole : j1;
    }
    if (count > 1) {                                   /* shared: the same physical block in every member */
        int32_t b = j0;
        for (; b < j1; b++) {
            const int32_t phys = rows[0].table[b];
            int same = 1;
            for (int32_t c = 1; c < count && same; c++) same = rows[c].table[b] == phys;
            if (!same) break;
        }
        j1 = b;
    }
    if (j1 < j0) j1 = j0;
    for (int32_t c = 0; c < count; c++) {
        const int32_t end = (rows[c].seq_len + bs - 1) / bs;
        visit_blocks(&rows[c], rows[c].lo / bs, end < j0 ? end : j0, 1, &it, kind, 1, NULL);
    }
    /* shared blocks: members in stacks of item_stack (the last stack may be smaller), each stack of two or more
     * with its query tiles after the members' own (one stack per two members at most), built once here */
    const int32_t run = it.tiles ? AMX_RUN : 1, stack = item_stack(&it);
    const uint32_t *stack_qt[MAX_MEMBERS];
    for (int32_t c = 0; c < count; c += stack) {
        const int32_t k = count - c < stack ? count - c : stack;
        stack_qt[c] = NULL;
#if AMX_SCORES
        if (k > 1 && j1 > j0) {
            uint32_t *qt = it.qt + (size_t)(count + c / stack) * (D / 2) * 16;
            amx_stack_tiles(&rows[c], k, G, D, qt);
            stack_qt[c] = qt;
        }
#endif
    }
    for (int32_t b0 = j0; b0 < j1; b0 += run)        /* a run of shared blocks, every stack of members in turn */
        for (int32_t c = 0; c < count; c += stack)
            visit_blocks(&rows[c], b0, b0 + run < j1 ? b0 + run : j1, c == 0, &it, kind,
                         count - c < stack ? count - c : stack, stack_qt[c]);
    const int permuted = it.fast && PAIRED_PV && (kind == KV_BF16 || kind == KV_I8);   /* PAIRED_PV: AVX512-BF16 */
    for (int32_t c = 0; c < count; c++) {
        rows_t *r = &rows[c];
        const int32_t from = j1 > r->lo / bs ? j1 : r->lo / bs;
        visit_blocks(r, from, (r->seq_len + bs - 1) / bs, 1, &it, kind, 1, NULL);
        rows_finish(r, out, ((int64_t)members[c] * num_heads + (int64_t)h * G) * D, G, D, permuted, io_bf16);
    }
    item_tiles_close(&it);
    free(fbuf);
    free(hbuf);
}

/* One work item's function per (cache kind, query/output dtype): a constant kind and io_bf16 each, so group_item's
 * always-inline paths specialize. bf16kv_f32: float32 queries and outputs over a bf16 cache (float32 activations,
 * kv_cache_dtype: bfloat16); i8kv_*: an int8 cache (kv_cache_dtype: int8). */
#define GROUP_ITEM(NAME, KIND, IO_BF16)                                                                          \
    static void NAME(const void *q, const void *k, const void *v, const int32_t *bt, int64_t ts,                \
                     const int32_t *lens, const int32_t *members, int32_t count, int32_t hq, int32_t hkv,       \
                     int32_t G, int32_t D, int32_t bs, int32_t window, float scale, int32_t h, void *out) {     \
        group_item(q, k, v, bt, ts, lens, members, count, hq, hkv, G, D, bs, window, scale, h, out, KIND,       \
                   IO_BF16);                                                                                     \
    }
GROUP_ITEM(group_item_bf16, KV_BF16, 1)
GROUP_ITEM(group_item_f32, KV_F32, 0)
GROUP_ITEM(group_item_bf16kv_f32, KV_BF16, 0)
GROUP_ITEM(group_item_i8kv_f32, KV_I8, 0)
GROUP_ITEM(group_item_i8kv_bf16, KV_I8, 1)

/* ---- grouping: sequences sorted by their block tables, cut into runs that start on the same block -------- */

typedef struct {
    const int32_t *tables;
    int64_t stride;
    const int32_t *lens;
    int32_t bs;
} tables_t;

/* Lexicographic order of two sequences' block tables (over the blocks both have), then index. */
static int table_less(const tables_t *t, int32_t a, int32_t b) {
    const int32_t na = (t->lens[a] + t->bs - 1) / t->bs, nb = (t->lens[b] + t->bs - 1) / t->bs;
    const int32_t n = na < nb ? na : nb;
    const int32_t *ta = t->tables + a * t->stride, *tb = t->tables + b * t->stride;
    for (int32_t j = 0; j < n; j++)
        if (ta[j] != tb[j]) return ta[j] < tb[j];
    return a < b;
}

/* order[0..n) sorted by table_less: a stable bottom-up merge sort (n is the decode batch, at most a few hundred). */
static void sort_by_tables(const tables_t *t, int32_t *order, int32_t *tmp, int32_t n) {
    for (int32_t i = 0; i < n; i++) order[i] = i;
    for (int32_t w = 1; w < n; w *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * w) {
            const int32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = table_less(t, order[j], order[i]) ? order[j++] : order[i++];
            while (i < mid) tmp[k++] = order[i++];
            while (j < hi) tmp[k++] = order[j++];
        }
        memcpy(order, tmp, sizeof(int32_t) * n);
    }
}

/* Cut the sorted order into groups: a new group where the first block changes, or at `cap` members.
 * starts[g] .. starts[g + 1] index `order`; returns the number of groups. */
static int32_t cut_groups(const tables_t *t, const int32_t *order, int32_t n, int32_t cap, int32_t *starts) {
    int32_t groups = 0;
    for (int32_t i = 0; i < n; i++) {
        const int new_run = i == 0 || t->tables[order[i] * t->stride] != t->tables[order[i - 1] * t->stride];
        if (new_run || i - starts[groups - 1] >= cap) starts[groups++] = i;
    }
    starts[groups] = n;
    return groups;
}

/* ---- entry points --------------------------------------------------------------------------------------- */

/* Members per group: enough groups to keep every thread busy (about four items per thread), at most
 * MAX_MEMBERS. A shared block is then read from memory once per group instead of once per sequence. */

#define ENTRY(NAME, T, TC, ITEM)                                                                                 \
    int NAME(const T *q, const TC *k_cache, const TC *v_cache, const int32_t *block_tables, int64_t table_stride,\
             const int32_t *seq_lens, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,               \
             int32_t head_dim, int32_t block_size, int32_t window, float scale, T *out, int32_t num_threads) { \
        if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP              \
            || block_size < 1 || block_size > MAX_BLOCK || head_dim < 1)                                      \
            return 1;                                                                                         \
        if (num_seqs < 1) return 0;                                                                           \
        const int32_t G = num_heads / num_kv_heads;                                                           \
        int32_t *order = (int32_t *)malloc(sizeof(int32_t) * (3 * (size_t)num_seqs + 1));                     \
        int32_t *tmp = order + num_seqs, *starts = tmp + num_seqs;                                            \
        const tables_t t = {block_tables, table_stride, seq_lens, block_size};                                \
        sort_by_tables(&t, order, tmp, num_seqs);                                                             \
        const int32_t want = 4 * (num_threads > 0 ? num_threads : 1);                                         \
        int32_t cap = (num_seqs * num_kv_heads + want - 1) / want;                                            \
        cap = cap < 1 ? 1 : (cap > MAX_MEMBERS ? MAX_MEMBERS : cap);                                          \
        const int32_t groups = cut_groups(&t, order, num_seqs, cap, starts);                                  \
        const int64_t items = (int64_t)groups * num_kv_heads;                                                 \
        (void)num_threads;                                                                                    \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                            \
        for (int64_t it = 0; it < items; it++) {                                                              \
            const int32_t g = (int32_t)(it / num_kv_heads);                                                   \
            ITEM(q, k_cache, v_cache, block_tables, table_stride, seq_lens, order + starts[g],                \
                 starts[g + 1] - starts[g], num_heads, num_kv_heads, G, head_dim, block_size, window, scale,   \
                 (int32_t)(it % num_kv_heads), out);                                                          \
        }                                                                                                     \
        free(order);                                                                                          \
        return 0;                                                                                             \
    }

ENTRY(paged_decode_bf16, uint16_t, uint16_t, group_item_bf16)
ENTRY(paged_decode_f32, float, float, group_item_f32)
ENTRY(paged_decode_bf16kv_f32, float, uint16_t, group_item_bf16kv_f32)
ENTRY(paged_decode_i8kv_f32, float, int8_t, group_item_i8kv_f32)
ENTRY(paged_decode_i8kv_bf16, uint16_t, int8_t, group_item_i8kv_bf16)

#endif
