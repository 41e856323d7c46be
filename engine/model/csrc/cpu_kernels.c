#include "prelude.h"

#include <omp.h>
#include <unistd.h>

/* The L2 size per core (sysconf; 512 KiB where it does not say; KVCHAT_L2_BYTES overrides it at build time) */
static int64_t l2_bytes(void) {
#ifdef KVCHAT_L2_BYTES
    return KVCHAT_L2_BYTES;
#else
    static int64_t cached = 0;
    if (cached == 0) {
        const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
        cached = size > 0 ? size : 512 * 1024;
    }
    return cached;
#endif
}

#ifndef PREFETCH
#define PREFETCH 32 /* tokens ahead (K/V rows of a kv head are strided and blocks jump); 16 x 1k fp32: 46 -> 39 ms */
#endif

/* a . b with a tree reduction over 16 lanes (an in-order reduction would serialise 16 dependent adds) */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, const int64_t dim) {
    if (dim % 16 != 0) {
        float total = 0.0f;
        for (int64_t d = 0; d < dim; d++) total += a[d] * b[d];
        return total;
    }
    v16f acc = load16(a) * load16(b);
    for (int64_t c = 16; c < dim; c += 16) acc += load16(a + c) * load16(b + c);
    const v16i h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const v16i h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const v16i h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const v16i h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    acc += __builtin_shuffle(acc, h8);
    acc += __builtin_shuffle(acc, h4);
    acc += __builtin_shuffle(acc, h2);
    acc += __builtin_shuffle(acc, h1);
    return acc[0];
}

/* Software pipelining across work items: while a thread computes one item, it prefetches (into L2) the K and V rows
   of its next item, token i's as it passes token i (each kv head's score pass the next item's K rows of one kv head,
   each values pass its V rows), so loads overlap arithmetic all along, instead of arriving in a burst during the
   first kv head's score pass while the other passes leave memory idle. Measured on a 2-core AVX512-BF16 EPYC, 16 x
   1k context, bf16, 30 layers, K/V from memory: 21.3 -> 17.2 ms together with the bf16 value pairs and the scores
   summed in registers (in cache: 12.3 -> 10.5), 15.5-16.5 ms with 128-token items (PART). Tried: whole records
   (every kv head) in token order, spread over the passes: 17.3 vs 16.2 ms here; prefetching into L1 (T0): twice
   as slow. */
typedef struct {
    const char *k, *v;   /* the next item's pools, offset to the kv head this pass fetches for */
    const int64_t *offs; /* its tokens' element offsets */
    int64_t n;           /* its tokens (0: nothing to fetch) */
} pf_next;

/* Token i's row (one kv head: dim elements of esize bytes) into L2. NOTE: dim and esize are arguments, not fields,
   so that they are constants where the score and value passes are inlined for one (dim, dtype): the address and the
   loop over the row's lines fold away. 16 x 1k context, bf16, 30 layers, Zen 4, two interleaved runs: K/V in cache
   10.9-12.6 -> 9.1-10.5 ms; from memory (huge pages), consecutive blocks 15.5-16.5 -> 15.3-15.8, shuffled 20.2-22.7
   -> 19.2-21.9; same bits. */
static inline __attribute__((always_inline)) void pf_token(const pf_next *p, const char *base, const int64_t i,
                                                           const int64_t dim, const int64_t esize) {
    if (i < p->n) {
        const char *row = base + p->offs[i] * esize;
        for (int64_t c = 0; c < dim * esize; c += 64) __builtin_prefetch(row + c, 0, 2); /* (into L2) */
    }
}

/* This item's token i + PREFETCH's row of one pool (pf_len elements of esize bytes) into L1. */
static inline __attribute__((always_inline)) void fetch_row_ahead(const char *cache, const int64_t *offs,
                                                                  const int64_t i, const int64_t n,
                                                                  const int64_t pf_len, const int64_t esize) {
    if (pf_len && i + PREFETCH < n) {
        const char *row = cache + offs[i + PREFETCH] * esize;
        for (int64_t c = 0; c < pf_len * esize; c += 64) __builtin_prefetch(row + c);
    }
}

/* This item's token i + PREFETCH on its way (pf_len elements of esize bytes a row): K's row into L1, V's into L2. */
static inline __attribute__((always_inline)) void fetch_ahead(const char *k_cache, const char *v_cache,
                                                              const int64_t *offs, const int64_t i, const int64_t n,
                                                              const int64_t pf_len, const int64_t esize) {
    if (pf_len && i + PREFETCH < n) {
        const char *nk = k_cache + offs[i + PREFETCH] * esize, *nv = v_cache + offs[i + PREFETCH] * esize;
        for (int64_t c = 0; c < pf_len * esize; c += 64) __builtin_prefetch(nk + c);
        for (int64_t c = 0; c < pf_len * esize; c += 64) __builtin_prefetch(nv + c, 0, 2);
    }
}

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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define DECODE_AVX2 1

/* out[j] = sum of v[j]'s 8 lanes, for 8 vectors (hadd tree, one cross-lane step) */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 *v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* fp32 pool, dim % 32 == 0, AVX2 without AVX-512 (where 16-lane vectors are pairs of registers and their
   reductions cost more than the products). Scores: per token, K's row is loaded into registers once and each query
   row's products summed into one 8-lane vector; 8 tokens' vectors are reduced together (sum8x8). Values: 3 query
   rows x 32 dims of accumulators (12 registers) over the part's tokens, the broadcast weight times V's row.
   Measured on a Zen 1 EPYC, 16 x 1k context, 30 layers: 61 -> 44 ms with K/V in cache, 94 -> 78 ms from memory. */
static inline __attribute__((always_inline)) void scores_avx2(
    const int64_t dim, const int64_t group, const float *qf, const float *k_cache, const float *v_cache,
    const int64_t *offs, const int64_t n, const int64_t part_len, float *restrict s, float *restrict red,
    const int64_t pf_len, const pf_next *pf)
{
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        for (int64_t t = 0; t < 8; t++) {
            pf_token(pf, pf->k, i0 + t, dim, 4);
            fetch_ahead((const char *)k_cache, (const char *)v_cache, offs, i0 + t, n, pf_len, 4);
            if (i0 + t >= n) {
                for (int64_t g = 0; g < group; g++) memset(red + (g * 8 + t) * 8, 0, 32);
                continue;
            }
            const float *k = k_cache + offs[i0 + t];
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * dim;
                __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
                __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), _mm256_loadu_ps(k + 8));
                for (int64_t c = 16; c < dim; c += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(k + c), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c + 8), _mm256_loadu_ps(k + c + 8), a1);
                }
                _mm256_storeu_ps(red + (g * 8 + t) * 8, _mm256_add_ps(a0, a1));
            }
        }
        for (int64_t g = 0; g < group; g++) {
            __m256 v[8];
            for (int t = 0; t < 8; t++) v[t] = _mm256_loadu_ps(red + (g * 8 + t) * 8);
            _mm256_storeu_ps(s + g * part_len + i0, sum8x8(v));
        }
    }
}

/* acc[g][d0 .. d0 + 32) for NG query rows from g0 (a constant count, so the accumulators stay in registers) */
#define VALUES_TILE(NG)                                                                                       \
static inline __attribute__((always_inline)) void values_tile_##NG(                                          \
    const int64_t dim, const int64_t g0, const int64_t d0, const float *v_cache, const int64_t *offs,         \
    const int64_t n, const int64_t part_len, const float *restrict s, float *restrict acc, const int64_t pf_len, \
    const pf_next *pf)                                                                                            \
{                                                                                                             \
    __m256 a[NG][4];                                                                                          \
    for (int g = 0; g < NG; g++)                                                                              \
        for (int c = 0; c < 4; c++) a[g][c] = _mm256_setzero_ps();                                            \
    for (int64_t i = 0; i < n; i++) {                                                                         \
        if (d0 == 0 && g0 == 0) pf_token(pf, pf->v, i, dim, 4);                                               \
        if (pf_len && i + PREFETCH < n && d0 == 0 && g0 == 0) {                                               \
            const char *nv = (const char *)(v_cache + offs[i + PREFETCH]);                                    \
            for (int64_t c = 0; c < pf_len * 4; c += 64) __builtin_prefetch(nv + c);                          \
        }                                                                                                     \
        const float *v = v_cache + offs[i] + d0;                                                              \
        __m256 p[NG]; /* (12 accumulators + 3 weights + one V vector: all 16 registers, no spill) */          \
        for (int g = 0; g < NG; g++) p[g] = _mm256_broadcast_ss(s + (g0 + g) * part_len + i);                 \
        for (int c = 0; c < 4; c++) {                                                                         \
            const __m256 vc = _mm256_loadu_ps(v + 8 * c);                                                     \
            for (int g = 0; g < NG; g++) a[g][c] = _mm256_fmadd_ps(p[g], vc, a[g][c]);                        \
        }                                                                                                     \
    }                                                                                                         \
    for (int g = 0; g < NG; g++)                                                                              \
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (g0 + g) * dim + d0 + 8 * c, a[g][c]);            \
}
VALUES_TILE(3)
VALUES_TILE(1)

static inline __attribute__((always_inline)) void values_avx2(
    const int64_t dim, const int64_t group, const float *v_cache, const int64_t *offs, const int64_t n,
    const int64_t part_len, const float *restrict s, float *restrict acc, const int64_t pf_len, const pf_next *pf)
{
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        int64_t g0 = 0;
        for (; g0 + 3 <= group; g0 += 3) values_tile_3(dim, g0, d0, v_cache, offs, n, part_len, s, acc, pf_len, pf);
        for (; g0 < group; g0++) values_tile_1(dim, g0, d0, v_cache, offs, n, part_len, s, acc, pf_len, pf);
    }
}
#else
#define DECODE_AVX2 0
#endif

/* 16 values of a bf16 or fp32 row as fp32 */
static inline __attribute__((always_inline)) v16f load16_any(const void *base, int64_t off, int bf16) {
    return bf16 ? bf16_load16((const uint16_t *)base + off) : load16((const float *)base + off);
}

/* acc[g][:] = sum_i s[g][i] v_i over the part's tokens, dim % 64 == 0: 4 query rows x 64 dims of accumulators stay
   in registers across the tokens (the plain loop loads and stores its accumulators for every token and row). */
static inline __attribute__((always_inline)) void values_tiled(
    const int64_t dim, const int bf16, const int64_t group, const void *v_cache, const int64_t *offs,
    const int64_t n, const int64_t part_len, const float *restrict s, float *restrict acc, const int64_t pf_len,
    const pf_next *pf)
{
    enum { GT = 4 };
    for (int64_t g0 = 0; g0 < group; g0 += GT) {
        const int64_t ng = group - g0 < GT ? group - g0 : GT;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            v16f a[GT][4];
            for (int g = 0; g < GT; g++)
                for (int c = 0; c < 4; c++) a[g][c] = (v16f){};
            for (int64_t i = 0; i < n; i++) {
                if (d0 == 0 && g0 == 0) pf_token(pf, pf->v, i, dim, bf16 ? 2 : 4);
                if (pf_len && i + PREFETCH < n && d0 == 0 && g0 == 0) {
                    const char *nv = (const char *)v_cache + offs[i + PREFETCH] * (bf16 ? 2 : 4);
                    for (int64_t c = 0; c < pf_len * (bf16 ? 2 : 4); c += 64) __builtin_prefetch(nv + c);
                }
                v16f v[4];
                for (int c = 0; c < 4; c++) v[c] = load16_any(v_cache, offs[i] + d0 + 16 * c, bf16);
                for (int g = 0; g < GT; g++) {
                    if (g >= ng) break;
                    const v16f p = splat16(s[(g0 + g) * part_len + i]);
                    for (int c = 0; c < 4; c++) a[g][c] += p * v[c];
                }
            }
            for (int g = 0; g < ng; g++)
                for (int c = 0; c < 4; c++) memcpy(acc + (g0 + g) * dim + d0 + 16 * c, &a[g][c], 64);
        }
    }
}

/* One work item: query group of kv head `kvh` of sequence `b` over tokens [t0, t0 + n). Inlined with constant
   `dim`/`bf16` (see run_part) so the short per-token loops unroll into straight vector code. */
static inline __attribute__((always_inline)) void part(
    const int64_t dim, const int bf16, const int64_t group, const int64_t kv_heads, const int64_t kvh,
    const void *q, int64_t q_off, const void *k_cache, const void *v_cache,
    const int64_t *offs, int64_t n, int64_t part_len, float scale,
    float *restrict qf, float *restrict s, float *restrict tmp, float *restrict acc, float *mx, float *sm,
    float *restrict red, const int64_t pf_len, const pf_next *pf, uint16_t *restrict ph)
{
    (void)kv_heads, (void)red, (void)ph; /* (used by some builds' paths only) */
    const int pair_scores = DECODE_PAIRS && bf16 && dim % 32 == 0; /* (scores_pairs reads q as stored) */
    for (int64_t g = 0; g < group && !pair_scores; g++) {
        const float *src = row_f32(q, q_off + (kvh * group + g) * dim, dim, bf16, tmp);
        for (int64_t d = 0; d < dim; d++) qf[g * dim + d] = src[d] * scale;
    }
#if DECODE_AVX2
    if (!bf16 && dim % 32 == 0)
        scores_avx2(dim, group, qf, (const float *)k_cache, (const float *)v_cache, offs, n, part_len, s, red, pf_len,
                    pf);
    else
#endif
#if DECODE_PAIRS
    if (pair_scores)
        scores_pairs(dim, group, (const uint16_t *)q + q_off + kvh * group * dim, (const uint16_t *)k_cache,
                     (const uint16_t *)v_cache, offs, n, part_len, scale, s, pf_len, pf, mx);
    else
#endif
    for (int64_t i = 0; i < n; i++) {
        pf_token(pf, pf->k, i, dim, bf16 ? 2 : 4);
        fetch_row_ahead((const char *)k_cache, offs, i, n, pf_len, bf16 ? 2 : 4);
        const float *k = row_f32(k_cache, offs[i], dim, bf16, tmp);
        for (int64_t g = 0; g < group; g++) {
            s[g * part_len + i] = dot(qf + g * dim, k, dim);
        }
    }
    /* scores_pairs leaves each query row's maximum score in mx (its scores past the end, where the last vector
       reads the last token again, repeat a score: they cannot raise it) */
    const int max_done = pair_scores;
    const int pair_values = DECODE_PAIRS && bf16 && dim % 64 == 0;
    (void)pair_values; /* (read only where DECODE_PAIRS) */
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * part_len, m = max_done ? mx[g] : -3.0e38f, total = 0.0f;
        if (!max_done) {
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;
        }
        /* e = exp(s - m) over W lanes at a time (lanes past the end: 0), stored by STORE(i, e); total = their sum */
#define SOFTMAX_ROW(W, VF, VI, EXP, STORE)                                                                    \
    do {                                                                                                      \
        for (int64_t i = n; i % W != 0; i++) sg[i] = m - 100.0f; /* pad the last vector */                    \
        VI lane;                                                                                              \
        for (int l = 0; l < W; l++) lane[l] = l;                                                              \
        VF sums = {};                                                                                         \
        for (int64_t i = 0; i < n; i += W) {                                                                  \
            VF e;                                                                                             \
            memcpy(&e, sg + i, sizeof(VF));                                                                   \
            e = EXP(e - m);                                                                                   \
            e = (VF)((VI)e & (lane < (VI){} + (int32_t)(n - i)));                                             \
            STORE(i, e);                                                                                      \
            sums += e;                                                                                        \
        }                                                                                                     \
        for (int l = 0; l < W; l++) total += sums[l];                                                         \
    } while (0)
#define STORE_FP32(i, e) memcpy(sg + (i), &(e), sizeof(e))
#if DECODE_PAIRS
        if (pair_values) total = softmax_pairs(sg, n, m, ph + g * part_len);
        else
#endif
#if DECODE_AVX2
        if (!bf16) SOFTMAX_ROW(8, v8f, v8i, exp_neg8, STORE_FP32); /* (16-lane vectors are register pairs here) */
        else
#endif
        SOFTMAX_ROW(16, v16f, v16i, exp_neg16, STORE_FP32);
#undef STORE_FP32
#undef SOFTMAX_ROW
        mx[g] = m;
        sm[g] = total;
    }
#if DECODE_AVX2
    if (!bf16 && dim % 32 == 0) {
        values_avx2(dim, group, (const float *)v_cache, offs, n, part_len, s, acc, pf_len, pf);
        return;
    }
#endif
#if DECODE_PAIRS
    if (pair_values) {
        values_pairs(dim, group, (const uint16_t *)v_cache, offs, n, part_len, ph, acc, pf_len, pf);
        return;
    }
#endif
#ifdef __AVX512F__ /* (an AVX2 build's bf16 takes the plain loop: arrays of 16-lane vectors there live in memory) */
    if (dim % 64 == 0) {
        values_tiled(dim, bf16, group, v_cache, offs, n, part_len, s, acc, pf_len, pf);
        return;
    }
#endif
    for (int64_t x = 0; x < group * dim; x++) acc[x] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        pf_token(pf, pf->v, i, dim, bf16 ? 2 : 4);
        fetch_row_ahead((const char *)v_cache, offs, i, n, pf_len, bf16 ? 2 : 4);
        const float *v = row_f32(v_cache, offs[i], dim, bf16, tmp);
        for (int64_t g = 0; g < group; g++) {
            const float p = s[g * part_len + i];
            float *ag = acc + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) ag[d] += p * v[d];
        }
    }
}

static void run_part(
    int64_t dim, int bf16, int64_t group, int64_t kv_heads, int64_t kvh, const void *q, int64_t q_off,
    const void *k_cache, const void *v_cache, const int64_t *offs, int64_t n, int64_t part_len, float scale,
    float *qf, float *s, float *tmp, float *acc, float *mx, float *sm, float *red, int64_t pf_len, const pf_next *pf,
    uint16_t *ph)
{
#define PART_ARGS group, kv_heads, kvh, q, q_off, k_cache, v_cache, offs, n, part_len, scale, qf, s, tmp, acc, mx, sm, \
                  red, pf_len, pf, ph
    if (dim == 64 && bf16) part(64, 1, PART_ARGS);
    else if (dim == 64) part(64, 0, PART_ARGS);
    else if (dim == 128 && bf16) part(128, 1, PART_ARGS);
    else if (dim == 128) part(128, 0, PART_ARGS);
    else part(dim, bf16, PART_ARGS);
#undef PART_ARGS
}

/* Tokens of work item `task` (0 for a part past its sequence's end). */
static inline int64_t task_len(int64_t task, int grouped, int64_t nparts, int64_t kv_heads, int64_t part_len,
                               const int64_t *lens) {
    const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), t0 = (task % nparts) * part_len;
    return t0 >= lens[b] ? 0 : (lens[b] - t0 < part_len ? lens[b] - t0 : part_len);
}

/* offs[i] = element offset of token i's record (kv head 0) in work item `task`, block by block; returns its tokens */
static int64_t task_offs(int64_t task, int grouped, int64_t nparts, int64_t kv_heads, int64_t part_len, int64_t dim,
                         int64_t block_size, const int64_t *table, int64_t max_blocks, const int64_t *lens,
                         int64_t *offs) {
    const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), t0 = (task % nparts) * part_len;
    const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
    const int64_t *blocks = table + b * max_blocks;
    for (int64_t i = 0; i < n;) {
        const int64_t t = t0 + i, bi = t / block_size, within = t - bi * block_size;
        const int64_t base = (blocks[bi] * block_size + within) * kv_heads;
        for (int64_t j = 0; j < block_size - within && i < n; j++, i++) offs[i] = (base + j * kv_heads) * dim;
    }
    return n;
}

void kvchat_paged_decode(
    const void *q, int64_t q_stride, const int64_t *q_rows,
    const void *k_cache, const void *v_cache, int64_t block_size,
    const int64_t *table, int64_t max_blocks, const int64_t *lens,
    void *out, int64_t out_stride, const int64_t *out_rows,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int bf16, int nthreads, int64_t part_len)
{
    const int64_t group = heads / kv_heads;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int64_t nparts = (max_len + part_len - 1) / part_len;
    const int64_t per_task = group * (dim + 2); /* acc[group][dim], then max[group], sum[group] */
    /* Work items: (sequence, part) with all its kv heads in turn, when there are enough of them (16 x 1k
       context, bf16, from memory: 28 -> 24 ms against one item per kv head, when items prefetched their own
       tokens). Else (sequence, kv head, part), which keeps both threads busy on a lone short sequence. */
    const int grouped = batch * nparts >= 2 * nthreads && kv_heads > 1;
    const int64_t ntasks = grouped ? batch * nparts : batch * kv_heads * nparts;
    const int64_t nslots = batch * kv_heads * nparts;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(nslots * per_task));
    if (!scratch) return;
    const int64_t esize = bf16 ? 2 : 4;
    /* the pipelined prefetch holds two items' K/V in L2: only where they take at most half of it (else each item
       fetches its own tokens PREFETCH ahead). SmolLM2, 128-token items: 96 KiB in bf16, 192 in fp32. Measured, 16 x
       1k context, 30 layers, fp32 (384 KiB for two items) on a Zen 3 EPYC (512 KiB L2): 50 ms pipelined, 44 not. */
    const int pipelined = 2 * (2 * part_len * 2 * (grouped ? kv_heads : 1) * dim * esize) <= l2_bytes();

#pragma omp parallel num_threads(nthreads)
    {
        const size_t floats = (size_t)(group * dim + group * (part_len + 16) + dim + 64 + group * 256
                                       + group * (part_len + 16) / 2); /* (then the bf16 weights) */
        float *buf = (float *)malloc(sizeof(float) * floats);
        int64_t *offs_buf = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * part_len));
        float *qf = buf, *s = buf + group * dim, *tmp = s + group * (part_len + 16), *red = tmp + dim + 64;
        uint16_t *ph = (uint16_t *)(red + group * 256);
        /* This thread's items: a contiguous run, split by token counts so that the threads get equal work (each
           item's next one is then known, for the pipelined prefetch). */
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t total = 0;
        for (int64_t task = 0; task < ntasks; task++)
            total += task_len(task, grouped, nparts, kv_heads, part_len, lens);
        int64_t lo = ntasks, hi = ntasks, seen = 0;
        for (int64_t task = 0; task < ntasks; task++) {
            const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
            int owner = total ? (int)(((2 * seen + n) * nth) / (2 * total)) : 0; /* by the item's middle */
            owner = owner < nth ? owner : nth - 1; /* (empty items at the end) */
            seen += n;
            if (owner == tid && lo == ntasks) lo = task;
            if (owner > tid) { hi = task; break; }
        }
        int64_t *offs = offs_buf, *next_offs = offs_buf + part_len;
        if (lo < hi) task_offs(lo, grouped, nparts, kv_heads, part_len, dim, block_size, table, max_blocks, lens, offs);
        int fetched = 0;
        for (int64_t task = lo; task < hi; task++) {
            const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), p = task % nparts;
            const int64_t kv_lo = grouped ? 0 : (task / nparts) % kv_heads, kv_hi = grouped ? kv_heads : kv_lo + 1;
            const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
            pf_next pf = {0};
            int64_t next_kv = 0;
            if (task + 1 < hi) {
                const int64_t next_n = task_offs(task + 1, grouped, nparts, kv_heads, part_len, dim, block_size,
                                                 table, max_blocks, lens, next_offs);
                pf.n = pipelined && n > 0 ? next_n : 0; /* (an empty item has no passes to fetch during) */
                pf.offs = next_offs;
                next_kv = grouped ? 0 : ((task + 1) / nparts) % kv_heads;
            }
            for (int64_t kvh = kv_lo; kvh < kv_hi; kvh++) {
                float *acc = scratch + ((b * kv_heads + kvh) * nparts + p) * per_task, *mx = acc + group * dim;
                float *sm = mx + group;
                if (n == 0) {
                    for (int64_t g = 0; g < group; g++) { mx[g] = -3.0e38f; sm[g] = 0.0f; }
                    continue;
                }
                const char *kc = (const char *)k_cache + kvh * dim * esize;
                const char *vc = (const char *)v_cache + kvh * dim * esize;
                /* this pass fetches the next item's rows of its kv head number (kvh - kv_lo) */
                pf.k = (const char *)k_cache + (next_kv + kvh - kv_lo) * dim * esize;
                pf.v = (const char *)v_cache + (next_kv + kvh - kv_lo) * dim * esize;
                /* an item not prefetched (a thread's first) fetches its own tokens PREFETCH ahead */
                const int64_t pf_len = fetched ? 0 : grouped && kvh == kv_lo ? kv_heads * dim : dim;
                run_part(dim, bf16, group, kv_heads, kvh, q, q_rows[b] * q_stride, kc, vc, offs, n, part_len,
                         scale, qf, s, tmp, acc, mx, sm, red, pf_len, &pf, ph);
                for (int64_t i = n; i < pf.n; i++) { /* a next item longer than this one: the rest at once */
                    pf_token(&pf, pf.k, i, dim, esize);
                    pf_token(&pf, pf.v, i, dim, esize);
                }
            }
            fetched = pipelined && n > 0;
            int64_t *swap = offs;
            offs = next_offs;
            next_offs = swap;
        }
#pragma omp barrier

#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            const int64_t b = bh / heads, h = bh % heads, kvh = h / group, g = h % group;
            float m = -3.0e38f, total = 0.0f;
            for (int64_t p = 0; p < nparts; p++) {
                const float *acc = scratch + ((b * kv_heads + kvh) * nparts + p) * per_task;
                const float pm = acc[group * dim + g];
                m = pm > m ? pm : m;
            }
            for (int64_t d = 0; d < dim; d++) tmp[d] = 0.0f;
            for (int64_t p = 0; p < nparts; p++) {
                const float *acc = scratch + ((b * kv_heads + kvh) * nparts + p) * per_task;
                const float ps = acc[group * dim + group + g];
                if (ps == 0.0f) continue;
                const float w = exp_neg(acc[group * dim + g] - m);
                total += ps * w;
                for (int64_t d = 0; d < dim; d++) tmp[d] += acc[g * dim + d] * w;
            }
            const float inv = 1.0f / total;
            const int64_t off = out_rows[b] * out_stride + h * dim;
            if (bf16) {
                uint16_t *o = (uint16_t *)out + off;
                for (int64_t d = 0; d < dim; d++) o[d] = bf16_store(tmp[d] * inv);
            } else {
                float *o = (float *)out + off;
                for (int64_t d = 0; d < dim; d++) o[d] = tmp[d] * inv;
            }
        }
        free(offs_buf);
        free(buf);
    }
    free(scratch);
}

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

/* out[r] = the index of row r's largest value: the first of equal ones, or the first NaN if the row has one (as
   torch.argmax). A max pass, then a scan for the first index that holds it, both 16 lanes at a time: 16 x 49152
   logits, 2 threads, 0.64 ms with torch.argmax (a decode step of 16 streams spends it in the sampler). */
void kvchat_argmax(const float *x, int64_t rows, int64_t cols, int64_t *out, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float m = -__builtin_inff();
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < cols; i++) {
            const float v = row[i];
            nan |= v != v;
            m = v > m ? v : m;
        }
        int64_t i = 0;
        for (; i + 16 <= cols; i += 16) { /* (the chunk that holds the first match) */
            const v16f v = load16(row + i);
            const v16i hit = nan ? v != v : v == m;
            int any = 0;
            for (int l = 0; l < 16; l++) any |= hit[l];
            if (any) break;
        }
        while (i < cols && !(nan ? row[i] != row[i] : row[i] == m)) i++;
        out[r] = i < cols ? i : 0;
    }
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
