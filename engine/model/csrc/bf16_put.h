/* Output rows of a 16-output panel from fp32 accumulators (bf16_panels.c and amx_panels.c). */
#ifndef KVCHAT_BF16_PUT_H
#define KVCHAT_BF16_PUT_H
#include <stdint.h>
#include <immintrin.h>

/* rows r0 .. r0 + rt of y for panel p: + bias (fp32), rounded to bf16 (nearest even), outputs past O left out */
static inline void put(const __m512 *acc, const int rt, const int64_t r0, const int64_t p, const int64_t O,
                       const float *bias, uint16_t *y) {
    const int64_t o0 = p * 16, n = O - o0 < 16 ? O - o0 : 16;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + o0) : _mm512_setzero_ps();
    for (int r = 0; r < rt; r++) {
        const __m256bh h = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[r], b) : acc[r]);
        _mm256_mask_storeu_epi16(y + (r0 + r) * O + o0, mask, (__m256i)h);
    }
}

#endif
