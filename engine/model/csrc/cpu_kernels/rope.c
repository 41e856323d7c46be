#include "prelude.h"

/* RoPE on the q and k heads of a fused qkv row (rotate-half form, as transformers: x * cos + rotate_half(x) * sin,
   with `rope` rows = [cos | signed sin] per position), then q rotated in place and k, v stored into their pool slots.
   In bf16 every product and the sum are rounded to bf16, as torch's bf16 ops do. */
__attribute__((optimize("fp-contract=off"))) /* x*cos + r*sin rounded as torch does: two products, one sum */
void kvchat_rope_store(void *qkv, int64_t stride, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                       const void *rope, const int64_t *pos, const int64_t *slots, void *k_cache, void *v_cache,
                       int bf16, int nthreads)
{
    const int64_t half = dim / 2, rot = heads + kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 64)
    for (int64_t t = 0; t < n; t++) {
        float tmp[512];
        for (int64_t h = 0; h < rot + kv_heads; h++) {
            const int64_t src = t * stride + h * dim;
            int64_t dst; /* element offset of the output row */
            void *out;
            if (h < heads) { out = qkv; dst = src; }
            else if (h < rot) { out = k_cache; dst = (slots[t] * kv_heads + (h - heads)) * dim; }
            else { out = v_cache; dst = (slots[t] * kv_heads + (h - rot)) * dim; }
            if (bf16) {
                const uint16_t *x = (const uint16_t *)qkv + src, *cs = (const uint16_t *)rope + pos[t] * 2 * dim;
                uint16_t *o = (uint16_t *)out + dst;
                if (h >= rot) { memmove(o, x, sizeof(uint16_t) * dim); continue; }
                for (int64_t d = 0; d < dim; d++) {
                    const uint16_t *r = d < half ? x + d + half : x + d - half;
                    const uint16_t a = bf16_store(bf16_load(x + d) * bf16_load(cs + d));
                    const uint16_t b = bf16_store(bf16_load(r) * bf16_load(cs + dim + d));
                    tmp[d] = bf16_load(&a) + bf16_load(&b);
                }
                for (int64_t d = 0; d < dim; d++) o[d] = bf16_store(tmp[d]);
            } else {
                const float *x = (const float *)qkv + src, *cs = (const float *)rope + pos[t] * 2 * dim;
                float *o = (float *)out + dst;
                if (h >= rot) { memmove(o, x, sizeof(float) * dim); continue; }
                for (int64_t d = 0; d < dim; d++) {
                    const float r = d < half ? x[d + half] : x[d - half];
                    tmp[d] = x[d] * cs[d] + r * cs[dim + d];
                }
                memcpy(o, tmp, sizeof(float) * dim);
            }
        }
    }
}
