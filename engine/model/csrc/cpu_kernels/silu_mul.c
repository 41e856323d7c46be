#include "prelude.h"

/* silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) <= 1 so that nothing overflows */
static inline v16f silu16(v16f g) {
    const v16i neg = g < 0.0f;
    const v16f e = exp_neg16((v16f)((v16i)g | (v16i)splat16(-0.0f)));
    const v16f num = (v16f)(((v16i)e & neg) | ((v16i)splat16(1.0f) & ~neg));
    return g * num / (1.0f + e);
}
static inline v8f silu8(v8f g) { /* the same on 8 lanes */
    const v8i neg = g < 0.0f;
    const v8f e = exp_neg8((v8f)((v8i)g | ((v8i){} + INT32_MIN))); /* -|g| */
    const v8f num = (v8f)(((v8i)e & neg) | ((v8i)((v8f){} + 1.0f) & ~neg));
    return g * num / (1.0f + e);
}

/* out[r, j] = silu(gu[r, j]) * gu[r, inter + j]: SwiGLU over the fused gate/up product (rows of 2 * inter values),
   bf16 or fp32. In bf16 the silu is rounded to bf16 before the multiply, as torch's F.silu(gate) * up rounds. */
void kvchat_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * inter >= 8192)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t full = inter - inter % 16;
        if (bf16) {
            const uint16_t *gate = (const uint16_t *)gu + r * 2 * inter, *up = gate + inter;
            uint16_t *o = (uint16_t *)out + r * inter;
            for (int64_t j = 0; j < full; j += 16) {
                bf16_store16(o + j, bf16_round16(silu16(bf16_load16(gate + j))) * bf16_load16(up + j));
            }
            for (int64_t j = full; j < inter; j++) {
                const uint16_t s = bf16_store(silu16(splat16(bf16_load(gate + j)))[0]);
                o[j] = bf16_store(bf16_load(&s) * bf16_load(up + j));
            }
        } else {
            const float *gate = (const float *)gu + r * 2 * inter, *up = gate + inter;
            float *o = (float *)out + r * inter;
#ifdef __AVX512F__
            for (int64_t j = 0; j < full; j += 16) store16(o + j, silu16(load16(gate + j)) * load16(up + j));
#else
            for (int64_t j = 0; j < full; j += 8) {
                v8f g, u;
                memcpy(&g, gate + j, 32);
                memcpy(&u, up + j, 32);
                g = silu8(g) * u;
                memcpy(o + j, &g, 32);
            }
#endif
            for (int64_t j = full; j < inter; j++) o[j] = silu16(splat16(gate[j]))[0] * up[j];
        }
    }
}
