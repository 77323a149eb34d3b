/* The causal / sliding-window softmax of a prefill tile in one pass (bf16 and float32 scores); prefill/ calls
 * the float32 one per tile. */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

/* In place on scores [outer, t, g, S] (bf16 or float32; rows = outer * t * g, each of S keys): row r belongs to
 * query position q = q_start + (r / g) % t, column j to key position k = k_start + j. Keys with k > q, or with
 * k <= q - window when window > 0, get probability 0; the rest a float32 softmax (rounded to bf16 once).
 * One pass where torch makes four (mask fill, float32 softmax, cast, plus the mask itself). */
#define MASKED_SOFTMAX(NAME, T, LOAD, STORE)                                                                 \
    void NAME(T *scores, int64_t outer, int64_t t, int64_t g, int64_t S, int64_t q_start, int64_t k_start,    \
              int64_t window, int32_t num_threads) {                                                         \
        (void)num_threads;                                                                                   \
        const int64_t rows = outer * t * g;                                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                              \
        for (int64_t r = 0; r < rows; r++) {                                                                 \
            T *row = scores + r * S;                                                                         \
            const int64_t q = q_start + (r / g) % t;                                                         \
            int64_t j0 = window > 0 ? q - window + 1 - k_start : 0;     /* visible columns [j0, j1) */       \
            int64_t j1 = q - k_start + 1;                                                                    \
            j0 = j0 < 0 ? 0 : j0;                                                                            \
            j1 = j1 > S ? S : j1;                                                                            \
            float mx = -INFINITY;                                                                            \
            _Pragma("omp simd reduction(max:mx)")     /* exact in any order: vectorized */                  \
            for (int64_t j = j0; j < j1; j++) {                                                              \
                const float v = LOAD(row[j]);                                                                \
                mx = v > mx ? v : mx;                                                                        \
            }                                                                                                \
            float sum = 0.0f;                                                                                \
            float e[j1 > j0 ? j1 - j0 : 1];                                                                  \
            _Pragma("omp simd reduction(+:sum)")                                                             \
            for (int64_t j = j0; j < j1; j++) {                                                              \
                e[j - j0] = exp_clamped(LOAD(row[j]) - mx);                                                  \
                sum += e[j - j0];                                                                            \
            }                                                                                                \
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                                \
            for (int64_t j = 0; j < j0; j++) row[j] = 0;                                                     \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = j0; j < j1; j++) row[j] = STORE(e[j - j0] * inv);                               \
            for (int64_t j = j1 > j0 ? j1 : j0; j < S; j++) row[j] = 0;                                      \
        }                                                                                                    \
    }

static inline float same_f32(float x) { return x; }
MASKED_SOFTMAX(masked_softmax_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
MASKED_SOFTMAX(masked_softmax_f32, float, same_f32, same_f32)
