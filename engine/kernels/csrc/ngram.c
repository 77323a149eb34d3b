/* Prompt-lookup (n-gram) speculation: propose the tokens that followed the most recent earlier occurrence of
 * the context's last n tokens, for the longest n in [n_min, n_max] that occurs earlier. Exact integer matching
 * over int32 token ids; O(len * n_max) worst case per call, a few microseconds for a 2k-token context. */
#include <stdint.h>

#include "kernels.h"

/* ctx[0..len): prompt + output tokens. Writes up to k tokens to out; returns how many (0: no match). */
static int ngram_propose(const int32_t *ctx, int64_t len, int32_t n_min, int32_t n_max, int32_t k, int32_t *out) {
    if (k <= 0 || n_min < 1 || n_max < n_min || len < 2) return 0;
    for (int32_t n = n_max < len - 1 ? n_max : (int32_t)(len - 1); n >= n_min; n--) {
        const int32_t *suffix = ctx + len - n;
        /* candidate starts p: the n tokens at p match the suffix and at least one token follows them */
        for (int64_t p = len - n - 1; p >= 0; p--) {
            if (ctx[p + n - 1] != suffix[n - 1] || ctx[p] != suffix[0]) continue;
            int32_t j = 1;
            while (j < n - 1 && ctx[p + j] == suffix[j]) j++;
            if (j < n - 1) continue;
            int64_t start = p + n, m = len - start < k ? len - start : k;
            for (int64_t i = 0; i < m; i++) out[i] = ctx[start + i];
            return (int)m;
        }
    }
    return 0;
}

/* Many requests at once: contexts concatenated, request r at [offsets[r], offsets[r + 1]); out[r * k ...],
 * counts[r] = how many proposed. */
void ngram_propose_batch(const int32_t *ctx, const int64_t *offsets, int32_t num_reqs, int32_t n_min,
                         int32_t n_max, int32_t k, int32_t *out, int32_t *counts) {
    for (int32_t r = 0; r < num_reqs; r++)
        counts[r] = ngram_propose(ctx + offsets[r], offsets[r + 1] - offsets[r], n_min, n_max, k,
                                  out + (int64_t)r * k);
}
