/* Decode attention: one work item (a query group of one kv head over one part of a sequence's tokens) and the merge
   of a row's parts, shared by the lone-row kernel (decode_attention.c) and the verify kernel (verify_attention.c), so
   that a verify row is computed by the same code, with the same fp operations in the same order, as a decode row. */
#ifndef KVCHAT_DECODE_PART_H
#define KVCHAT_DECODE_PART_H

#include "prelude.h"

#include <unistd.h>

/* AVX2 + FMA without AVX-512 (Zen 1-3): the builds with their own prefetch distance, record fetches and 8-lane
   passes (decode_avx2.h) */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_ONLY 1
#else
#define AVX2_ONLY 0
#endif

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

/* Tokens ahead that an item fetches its own K/V rows (K/V rows of a kv head are strided and blocks jump). 16 x 1k
   fp32: 46 -> 39 ms. AVX2 builds without AVX-512 fetch 8 ahead: on a Zen 2 EPYC (fp32, 30 layers, K/V from memory,
   medians of 3 interleaved rounds, three runs) 16 x 2k 107-110 vs 113-116 ms at 32, 1 x 2k 7.3-7.5 vs 7.7-7.8, 16 x
   1k 55 vs 57-58; 4, 12 and 16 sat between, 64 and none were slower (120, 127 ms). */
#ifndef PREFETCH
#if AVX2_ONLY
#define PREFETCH 8
#else
#define PREFETCH 32
#endif
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
   as slow.
   AVX2 builds without AVX-512 fetch whole records instead (AVX2_ONLY): each call of pf_token takes the next
   dim * esize bytes of the next item's records, token by token, K and V line by line, so a token's passes (two per
   kv head) fetch one token's records, in address order. Zen 2 EPYC, fp32, 30 layers, K/V from memory, interleaved
   rounds: 16 x 2k 81 vs 111 ms (the rows of one kv head a pass, pipelined or not: 111), 1 x 2k 6.0 vs 8.3, 16 x 1k
   41.5 vs 56; same bits (only prefetches move). There two fp32 items (384 KiB) do not fit in half of the 512 KiB L2,
   so the rows-a-pass fetch was off; record fetches pipeline whenever two items fit in all of it. */
typedef struct {
    const char *k, *v;   /* the next item's pools, offset to the kv head this pass fetches for (records: to its
                            first kv head) */
    const int64_t *offs; /* its tokens' element offsets */
    int64_t n;           /* its tokens (0: nothing to fetch) */
    int records;         /* (AVX2_ONLY) fetch its whole records in order: the next item holds every kv head */
    int64_t rec_lines;   /* (AVX2_ONLY) cache lines of one token's record in one pool */
    int64_t *at;         /* (AVX2_ONLY) where the record fetch stands: token, line */
} pf_next;

/* Token i's row (one kv head: dim elements of esize bytes) into L2. NOTE: dim and esize are arguments, not fields,
   so that they are constants where the score and value passes are inlined for one (dim, dtype): the address and the
   loop over the row's lines fold away. 16 x 1k context, bf16, 30 layers, Zen 4, two interleaved runs: K/V in cache
   10.9-12.6 -> 9.1-10.5 ms; from memory (huge pages), consecutive blocks 15.5-16.5 -> 15.3-15.8, shuffled 20.2-22.7
   -> 19.2-21.9; same bits. */
static inline __attribute__((always_inline)) void pf_token(const pf_next *p, const char *base, const int64_t i,
                                                           const int64_t dim, const int64_t esize) {
#if AVX2_ONLY
    if (p->records) { /* the next dim * esize bytes of records, K and V in turn (see pf_next) */
        int64_t tok = p->at[0], line = p->at[1];
        if (tok >= p->n) return;
        const char *kr = p->k + p->offs[tok] * esize, *vr = p->v + p->offs[tok] * esize;
        for (int64_t c = 0; c < dim * esize; c += 128) {
            __builtin_prefetch(kr + line * 64, 0, 2);
            __builtin_prefetch(vr + line * 64, 0, 2);
            if (++line == p->rec_lines) {
                line = 0;
                if (++tok >= p->n) break;
                kr = p->k + p->offs[tok] * esize, vr = p->v + p->offs[tok] * esize;
            }
        }
        p->at[0] = tok, p->at[1] = line;
        return;
    }
#endif
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

#include "decode_bf16_pairs.h"

#include "decode_avx2.h"

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

/* One query row of one head from its parts' partial softmaxes (part p's at base + p * stride: its acc row at
   acc_off, its max at mx_off, its sum at sm_off), written to out + off; the parts in order, empty ones (sum 0)
   skipped. tmp: dim floats. */
static inline void merge_row(const float *base, const int64_t nparts, const int64_t stride, const int64_t acc_off,
                             const int64_t mx_off, const int64_t sm_off, const int64_t dim, const int bf16,
                             float *restrict tmp, void *out, const int64_t off)
{
    float m = -3.0e38f, total = 0.0f;
    for (int64_t p = 0; p < nparts; p++) {
        const float pm = base[p * stride + mx_off];
        m = pm > m ? pm : m;
    }
    for (int64_t d = 0; d < dim; d++) tmp[d] = 0.0f;
    for (int64_t p = 0; p < nparts; p++) {
        const float *acc = base + p * stride;
        const float ps = acc[sm_off];
        if (ps == 0.0f) continue;
        const float w = exp_neg(acc[mx_off] - m);
        total += ps * w;
        for (int64_t d = 0; d < dim; d++) tmp[d] += acc[acc_off + d] * w;
    }
    const float inv = 1.0f / total;
    if (bf16) {
        uint16_t *o = (uint16_t *)out + off;
        for (int64_t d = 0; d < dim; d++) o[d] = bf16_store(tmp[d] * inv);
    } else {
        float *o = (float *)out + off;
        for (int64_t d = 0; d < dim; d++) o[d] = tmp[d] * inv;
    }
}

#endif
