/* Decode attention, AVX512-BF16 builds: scores and values as bf16 pair products. Included by decode_attention.c
   after its prefetch helpers (which these use); DECODE_PAIRS says whether the build has them. */

#ifdef __AVX512BF16__
#include <immintrin.h>
#define DECODE_PAIRS 1

/* s[g][i] = scale * q_g . k_i for a bf16 pool with dim % 32 == 0: per token and query row, one 16-lane vector of
   bf16 pair products (vdpbf16ps on the row as stored: no conversion), then one sum16v per 16 tokens on vectors kept
   in registers. Replaces a conversion and a 16-lane reduction per (token, row): 16 x 1k context, bf16, 30 layers,
   pool in cache: 28 -> 22 ms. Also leaves each row's maximum score in mx[g], for the softmax. */
static inline __attribute__((always_inline)) void scores_pairs(
    const int64_t dim, const int64_t group, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *offs, const int64_t n, const int64_t part_len, const float scale, float *restrict s,
    const int64_t pf_len, const pf_next *pf, float *restrict mx)
{
    v16f top[group]; /* each query row's running maximum, lane-wise */
    for (int64_t g = 0; g < group; g++) top[g] = splat16(-3.0e38f);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        for (int64_t t = 0; t < 16; t++) {
            pf_token(pf, pf->k, i0 + t, dim, 2);
            fetch_ahead((const char *)k_cache, (const char *)v_cache, offs, i0 + t, n, pf_len, 2);
        }
        for (int64_t g = 0; g < group; g++) {
            v16f r[16]; /* 16 tokens' pair-product vectors, kept in registers for sum16v */
            for (int64_t t = 0; t < 16; t++) {
                /* (past the end: the last token again; those scores are overwritten by the softmax's padding) */
                const uint16_t *k = k_cache + offs[i0 + t < n ? i0 + t : n - 1];
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < dim; c += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + g * dim + c),
                                           (__m512bh)_mm512_loadu_si512(k + c));
                r[t] = (v16f)acc;
            }
            const v16f total = sum16v(r) * scale;
            memcpy(s + g * part_len + i0, &total, 64);
            top[g] = (v16f)_mm512_max_ps((__m512)total, (__m512)top[g]);
        }
    }
    for (int64_t g = 0; g < group; g++) mx[g] = _mm512_reduce_max_ps((__m512)top[g]);
}

/* acc[g][:] = sum_i p[g][i] v_i for a bf16 pool with dim % 64 == 0, as bf16 pair products: two tokens' V rows
   interleaved (vpunpck{l,h}wd) are one 16-lane vector of (v_i[d], v_i+1[d]) pairs, and (p_i, p_i+1) is one broadcast
   pair, so vdpbf16ps sums both tokens' products for 16 dims. The weights `ph` are the probabilities rounded to bf16
   (the softmax sums those same rounded values). The unpacks permute dims within each 128-bit lane: accumulator lo
   holds dims 8L..8L+3 and hi 8L+4..8L+7 of lane L, put back in order when stored. Per two tokens and kv head: 4
   loads, 4 unpacks and 4 products per query row, against 8 conversions and 8 products per row in values_tiled. */
static inline __attribute__((always_inline)) void values_pairs(
    const int64_t dim, const int64_t group, const uint16_t *v_cache, const int64_t *offs, const int64_t n,
    const int64_t part_len, const uint16_t *restrict ph, float *restrict acc, const int64_t pf_len, const pf_next *pf)
{
    enum { GT = 4 };
    for (int64_t g0 = 0; g0 < group; g0 += GT) {
        const int64_t ng = group - g0 < GT ? group - g0 : GT;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            __m512 lo[GT][2], hi[GT][2];
            for (int g = 0; g < GT; g++)
                for (int c = 0; c < 2; c++) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 2) {
                if (d0 == 0 && g0 == 0) {
                    pf_token(pf, pf->v, i, dim, 2);
                    pf_token(pf, pf->v, i + 1, dim, 2);
                    if (pf_len && i + PREFETCH < n) {
                        for (int64_t t = i + PREFETCH; t < i + PREFETCH + 2 && t < n; t++) {
                            const char *nv = (const char *)(v_cache + offs[t]);
                            for (int64_t c = 0; c < pf_len * 2; c += 64) __builtin_prefetch(nv + c);
                        }
                    }
                }
                const uint16_t *va = v_cache + offs[i] + d0;
                const __m512i a0 = _mm512_loadu_si512(va), a1 = _mm512_loadu_si512(va + 32);
                __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
                if (i + 1 < n) {
                    const uint16_t *vb = v_cache + offs[i + 1] + d0;
                    b0 = _mm512_loadu_si512(vb);
                    b1 = _mm512_loadu_si512(vb + 32);
                }
                const __m512bh p0l = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
                const __m512bh p0h = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
                const __m512bh p1l = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
                const __m512bh p1h = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
                for (int g = 0; g < GT; g++) {
                    if (g >= ng) break;
                    int32_t pair;
                    memcpy(&pair, ph + (g0 + g) * part_len + i, 4);
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
                    lo[g][0] = _mm512_dpbf16_ps(lo[g][0], p0l, w);
                    hi[g][0] = _mm512_dpbf16_ps(hi[g][0], p0h, w);
                    lo[g][1] = _mm512_dpbf16_ps(lo[g][1], p1l, w);
                    hi[g][1] = _mm512_dpbf16_ps(hi[g][1], p1h, w);
                }
            }
            const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            for (int g = 0; g < ng; g++) { /* dims in order: lo lane 0, hi lane 0, lo lane 1, hi lane 1, ... */
                float *out = acc + (g0 + g) * dim + d0;
                for (int c = 0; c < 2; c++) {
                    _mm512_storeu_ps(out + 32 * c, _mm512_permutex2var_ps(lo[g][c], first, hi[g][c]));
                    _mm512_storeu_ps(out + 32 * c + 16, _mm512_permutex2var_ps(lo[g][c], second, hi[g][c]));
                }
            }
        }
    }
}

/* One query row's softmax weights for values_pairs: ph[i] = exp(s[i] - m) rounded to bf16 for i < n, 0 up to the
   end of the last 16-lane vector; returns their sum (of the rounded values, lane-wise then lane by lane, as
   SOFTMAX_ROW). vcvtneps2bf16 rounds to nearest even as bf16_round16 does for these values (normal or 0: exp_neg16
   stops at e^-87), in one instruction instead of ~10; the mask only on the last vector. Same bits. 16 x 1k context,
   bf16, 30 layers, Zen 4, together with FLOOR16: the softmax 1.6-1.9 -> 0.9-1.3 ms a step; the decode attention with
   K/V in cache 8.4 -> 7.7 ms (fastest runs), from memory no change seen (15.1 vs 15.3: it waits on memory there). */
static inline __attribute__((always_inline)) float softmax_pairs(const float *sg, const int64_t n, const float m,
                                                                 uint16_t *restrict ph)
{
    __m512 sums = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keep = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(keep, (__m512)exp_neg16(load16(sg + i) - m));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i *)(ph + i), h);
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    const v16f lanes = (v16f)sums;
    float total = 0.0f;
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}
#else
#define DECODE_PAIRS 0
#endif
