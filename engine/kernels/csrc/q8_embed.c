/* Embedding rows from qlinear/'s packed int8 weights (a tied LM head / embedding is stored once, in int8). */
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "kernels.h"

#define QK 32          /* group size along K: qlinear/driver.h's packed layout */

/* Embedding lookup from the packed int8 weights: y[t, :K] = sw[row, g] * W[row, k] (sw in fp16) for row = ids[t].
 * Only the rows read are dequantized (a tied LM head / embedding is stored once, in int8). */
static void embed(const int8_t *w, const uint16_t *sw, int Kp, const int64_t *ids, int T, int K, void *y, int is_bf16,
                  int nt) {
    const int K4 = Kp / 4, G = Kp / QK;
#pragma omp parallel for schedule(static) num_threads(nt) if (T > 16)
    for (int t = 0; t < T; t++) {
        const int64_t row = ids[t];
        const int8_t *wb = w + (size_t)(row / 16) * K4 * 64 + (row % 16) * 4;
        const uint16_t *s = sw + (size_t)(row / 16) * G * 16 + row % 16;
        for (int k = 0; k < K; k++) {
            const float v = (float)wb[(size_t)(k / 4) * 64 + k % 4] * f16_to_f32(s[(size_t)(k / QK) * 16]);
            if (is_bf16) ((uint16_t *)y)[(size_t)t * K + k] = f32_to_bf16(v);
            else ((float *)y)[(size_t)t * K + k] = v;
        }
    }
}

void q8_embed_f32(const int8_t *w, const uint16_t *sw, int Kp, const int64_t *ids, int T, int K, float *y, int nt) {
    embed(w, sw, Kp, ids, T, K, y, 0, nt);
}
void q8_embed_bf16(const int8_t *w, const uint16_t *sw, int Kp, const int64_t *ids, int T, int K, uint16_t *y, int nt) {
    embed(w, sw, Kp, ids, T, K, y, 1, nt);
}
