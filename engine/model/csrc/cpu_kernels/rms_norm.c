#include "prelude.h"

/* out = rms_norm(x (+= residual)) * weight; rows of `hidden` values, bf16 or fp32. In bf16, as LlamaRMSNorm: the
   normalised row is rounded to bf16 before the weight multiply, whose product is rounded again. */
void kvchat_rms_norm(void *x, const void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                     float eps, int bf16, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        float sumsq = 0.0f;
        if (bf16) {
            uint16_t *xr = (uint16_t *)x + r * hidden;
            const uint16_t *res = residual ? (const uint16_t *)residual + r * hidden : 0;
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + r * hidden;
            const int64_t full = hidden - hidden % 16;
            v16f part = {0}; /* 16 running sums, as in fp32 below */
            for (int64_t i = 0; i < full; i += 16) {
                if (res) bf16_store16(xr + i, bf16_load16(xr + i) + bf16_load16(res + i));
                const v16f v = bf16_load16(xr + i);
                part += v * v;
            }
            for (int64_t i = full; i < hidden; i++) {
                if (res) xr[i] = bf16_store(bf16_load(xr + i) + bf16_load(res + i));
                const float v = bf16_load(xr + i);
                part[0] += v * v;
            }
            for (int width = 8; width >= 1; width /= 2)
                for (int l = 0; l < width; l++) part[l] += part[l + width];
            sumsq = part[0];
            const float rstd = 1.0f / __builtin_sqrtf(sumsq / (float)hidden + eps);
            for (int64_t i = 0; i < full; i += 16) {
                bf16_store16(o + i, bf16_load16(w + i) * bf16_round16(bf16_load16(xr + i) * rstd));
            }
            for (int64_t i = full; i < hidden; i++) {
                const uint16_t normed = bf16_store(bf16_load(xr + i) * rstd);
                o[i] = bf16_store(bf16_load(w + i) * bf16_load(&normed));
            }
        } else {
            float *xr = (float *)x + r * hidden;
            const float *res = residual ? (const float *)residual + r * hidden : 0;
            typedef float v8 __attribute__((vector_size(32)));
            v8 part = {0}; /* 8 running sums in one vector instead of one serial chain of `hidden` adds */
            int64_t i = 0;
            for (; i + 8 <= hidden; i += 8) {
                v8 a;
                memcpy(&a, xr + i, 32);
                if (res) {
                    v8 b;
                    memcpy(&b, res + i, 32);
                    a += b;
                    memcpy(xr + i, &a, 32);
                }
                part += a * a;
            }
            for (; i < hidden; i++) {
                if (res) xr[i] += res[i];
                part[0] += xr[i] * xr[i];
            }
            sumsq = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
            const float rstd = 1.0f / __builtin_sqrtf(sumsq / (float)hidden + eps);
            float *o = (float *)out + r * hidden;
            for (int64_t i = 0; i < hidden; i++) o[i] = ((const float *)weight)[i] * (xr[i] * rstd);
        }
    }
}
