#include "prelude.h"

/* The register tiles use the machine's own vector width (vt, VW lanes): arrays of wider GCC vectors stay in memory
   (AVX2 with v16f tiles: 3.6 GMAC/s instead of ~30). Rows are laid out in 16-row vectors either way. */
#ifdef __AVX512F__
typedef v16f vt;
typedef v16i vti;
#define exp_negv exp_neg16
#define VW 16
#define KT 4   /* keys per register tile */
#define DT 4   /* head dims per register tile of the V product */
#define WIDE 1 /* tiles of 4 row vectors: 16 accumulators (32 registers) */
#else
typedef float vt __attribute__((vector_size(32)));
typedef int32_t vti __attribute__((vector_size(32)));
#define exp_negv exp_neg8
#define VW 8
#define KT 2
#define DT 2
#define WIDE 0 /* 16 ymm registers: tiles of 2 row vectors (2 x 4 accumulators) */
#endif
#define CK 64 /* keys per chunk */
#ifndef PF
#define PF 64
#endif
#define MAXV 8 /* row vectors (16 rows each) per work item */

static inline vt loadv(const float *p) { vt v; memcpy(&v, p, sizeof(vt)); return v; }
static inline vti loadvi(const int32_t *p) { vti v; memcpy(&v, p, sizeof(vti)); return v; }
static inline void storev(float *p, vt v) { memcpy(p, &v, sizeof(vt)); }
#if VW == 16
static inline vt splatv(float x) { return splat16(x); }
#else
static inline vt splatv(float x) { return (vt){x, x, x, x, x, x, x, x}; }
#endif

/* v, held in a register: GCC would otherwise fold each reuse into an FMA as a memory operand, and the tiles then
   issue more vector loads than FMAs (AVX-512, one thread: 31 -> 37 GMAC/s). */
static inline __attribute__((always_inline)) vt in_register(vt v) {
#ifdef __AVX__
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* dst[0:n] = row as fp32 (a copy also for an fp32 row) */
static inline void row_to_f32(const void *base, int64_t off, int64_t n, int bf16, float *restrict dst) {
    const float *src = row_f32(base, off, n, bf16, dst);
    if (src != dst) memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* The register tile of both passes: out[k][u] = INIT + sum_i splatv(B) * a[i][u] for KN rows k of NR row vectors
   (a's rows nrows apart). Scores: keys x query rows over the head dims, from zero (s[j][rv] = q_rv . k_j); values:
   head dims x query rows over the keys, added to out (ot[d][rv] += sum_j p[j][rv] v_j[d]). b[j]: key or value j as
   fp32 (in the pool itself for an fp32 pool: no copy). */
#define OUTER_TILE(NAME, NR, KN, INIT, B)                                                                      \
    static inline __attribute__((always_inline)) void NAME##_##NR(const int64_t len, const float *restrict a,  \
        int64_t nrows, const float *const *b, int64_t b0, float *restrict out) {                               \
        enum { NU = NR * 16 / VW };                                                                            \
        vt acc[KN][NU];                                                                                        \
        for (int k = 0; k < KN; k++)                                                                           \
            for (int u = 0; u < NU; u++) acc[k][u] = INIT;                                                     \
        for (int64_t i = 0; i < len; i++) {                                                                    \
            vt x[NU];                                                                                          \
            for (int u = 0; u < NU; u++) x[u] = in_register(loadv(a + i * nrows + VW * u));                    \
            for (int k = 0; k < KN; k++) {                                                                     \
                const vt bk = splatv(B);                                                                       \
                for (int u = 0; u < NU; u++) acc[k][u] += bk * x[u];                                           \
            }                                                                                                  \
        }                                                                                                      \
        for (int k = 0; k < KN; k++)                                                                           \
            for (int u = 0; u < NU; u++) storev(out + k * nrows + VW * u, acc[k][u]);                          \
    }
#define FROM_ZERO ((vt){})
#define ADDED_TO_OUT loadv(out + k * nrows + VW * u)
OUTER_TILE(score, 4, KT, FROM_ZERO, b[b0 + k][i])
OUTER_TILE(score, 2, KT, FROM_ZERO, b[b0 + k][i])
OUTER_TILE(score, 1, KT, FROM_ZERO, b[b0 + k][i])
OUTER_TILE(value, 4, DT, ADDED_TO_OUT, b[i][b0 + k])
OUTER_TILE(value, 2, DT, ADDED_TO_OUT, b[i][b0 + k])
OUTER_TILE(value, 1, DT, ADDED_TO_OUT, b[i][b0 + k])

#ifdef __AVX512BF16__
#include <immintrin.h>
#define PAIRS 1 /* bf16 pools: products of bf16 pairs with fp32 sums (vdpbf16ps), twice the FMAs' rate */

/* OUTER_TILE over bf16 pairs: out[k][u] = INIT + sum_i a[i][u] . B (vdpbf16ps: a 32-bit lane holds a pair of
   bf16 values of a row, B the pair of row k it multiplies). Scores: a = qp[i][r] (q[r][2i], q[r][2i+1]), B from the
   bf16 key rows krow[j]; values: a = pp[jp][r] (p[2jp][r], p[2jp+1][r]), B = vp[jp][d] (v_2jp[d], v_2jp+1[d]). */
static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, 4);
    return pair;
}
#define OUTER_PAIRS(NAME, NR, KN, INIT, B)                                                                           \
    static inline __attribute__((always_inline)) void NAME##_##NR(const int64_t len, const uint32_t *restrict a,     \
        int64_t nrows, const void *b, int64_t b0, int64_t bstride, float *restrict out) {                            \
        (void)bstride;                                                                                               \
        __m512 acc[KN][NR];                                                                                          \
        for (int k = 0; k < KN; k++)                                                                                 \
            for (int v = 0; v < NR; v++) acc[k][v] = INIT;                                                           \
        for (int64_t i = 0; i < len; i++) {                                                                          \
            __m512i x[NR];                                                                                           \
            for (int v = 0; v < NR; v++) x[v] = _mm512_loadu_si512(a + i * nrows + 16 * v);                          \
            for (int k = 0; k < KN; k++) {                                                                           \
                const __m512i bk = _mm512_set1_epi32((int)(B));                                                      \
                for (int v = 0; v < NR; v++) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], (__m512bh)x[v], (__m512bh)bk);  \
            }                                                                                                        \
        }                                                                                                            \
        for (int k = 0; k < KN; k++)                                                                                 \
            for (int v = 0; v < NR; v++) _mm512_storeu_ps(out + k * nrows + 16 * v, acc[k][v]);                      \
    }
#define PAIRS_FROM_ZERO _mm512_setzero_ps()
#define PAIRS_ADDED_TO_OUT _mm512_loadu_ps(out + k * nrows + 16 * v)
#define KEY_PAIR load_pair(((const uint16_t *const *)b)[b0 + k] + 2 * i)
#define VALUE_PAIR ((const uint32_t *)b)[i * bstride + b0 + k]
OUTER_PAIRS(score_pairs, 4, KT, PAIRS_FROM_ZERO, KEY_PAIR)
OUTER_PAIRS(score_pairs, 2, KT, PAIRS_FROM_ZERO, KEY_PAIR)
OUTER_PAIRS(score_pairs, 1, KT, PAIRS_FROM_ZERO, KEY_PAIR)
OUTER_PAIRS(value_pairs, 4, DT, PAIRS_ADDED_TO_OUT, VALUE_PAIR)
OUTER_PAIRS(value_pairs, 2, DT, PAIRS_ADDED_TO_OUT, VALUE_PAIR)
OUTER_PAIRS(value_pairs, 1, DT, PAIRS_ADDED_TO_OUT, VALUE_PAIR)
#else
#define PAIRS 0
#endif

static const uint16_t ZERO_ROW[512]; /* a padding key / value row */
static const float ZERO_F32[256];    /* the same, fp32 (MAX_HEAD_DIM) */

/* One work item: rows r = t * group + g (position p0 + t, query head kvh * group + g) of the chunk, held as
   16-row vectors: q transposed to qt[d][r] (fp32, scaled; or qp[i][r] bf16 pairs), scores as s[j][r], the output
   accumulated as ot[d][r]. Inlined with a constant head dim D so the loops over D unroll. `pairs`: bf16 pool and
   vdpbf16ps available. */
static inline __attribute__((always_inline)) void tile(
    const int64_t D, const int bf16, const int pairs, const int64_t group, const int64_t kv_heads, const int64_t kvh,
    const void *q, const int64_t q_stride, void *out, const int64_t out_stride, const int64_t p0, const int64_t tq,
    const int64_t start_pos, const void *k_cache, const void *v_cache, const int64_t block_size,
    const int64_t *table, const float scale, float *restrict qt, float *restrict ot, float *restrict s,
    float *restrict kb, float *restrict vb, uint32_t *restrict pp, const uint16_t **krow, float *restrict tmp)
{
    const int64_t rows = tq * group, nv = (rows + 15) / 16, nrows = nv * 16;
    uint32_t *qp = (uint32_t *)qt, *vp = (uint32_t *)vb;
    const float *kf[CK + KT], *vf[CK + KT]; /* the chunk's K and V rows as fp32 (not for pairs) */
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t t = r / group, h = kvh * group + r % group, off = (p0 + t) * q_stride + h * D;
        if (pairs) {
            const uint16_t *src = (const uint16_t *)q + off;
            for (int64_t i = 0; i < D / 2; i++)
                qp[i * nrows + r] = r < rows ? (uint32_t)src[2 * i] | (uint32_t)src[2 * i + 1] << 16 : 0u;
        } else if (r < rows) {
            row_to_f32(q, off, D, bf16, tmp);
            for (int64_t d = 0; d < D; d++) qt[d * nrows + r] = tmp[d] * scale;
        } else {
            for (int64_t d = 0; d < D; d++) qt[d * nrows + r] = 0.0f;
        }
        for (int64_t d = 0; d < D; d++) ot[d * nrows + r] = 0.0f;
    }
    const float s_scale = pairs ? scale : 1.0f; /* fp32: q was scaled */
    /* per row (lane): the running maximum and sum, and its absolute position (it sees keys 0..pos) */
    float m[16 * MAXV], l[16 * MAXV];
    int32_t pos[16 * MAXV];
    for (int64_t r = 0; r < nrows; r++) {
        m[r] = -3.0e38f;
        l[r] = 0.0f;
        pos[r] = (int32_t)(start_pos + p0 + (r < rows ? r / group : -1)); /* (padding rows: never written) */
    }
    const int64_t end = start_pos + p0 + tq; /* keys [0, end): the last row's causal horizon */
    for (int64_t c0 = 0; c0 < end; c0 += CK) {
        const int64_t n = end - c0 < CK ? end - c0 : CK, nk = (n + KT - 1) / KT * KT, npairs = (n + 1) / 2;
        /* the next chunk's K/V rows, fetched while this one computes: rows of a kv head are strided and blocks jump,
           and this layer's pool comes from memory (30 layers at 30 x 2k, bf16: 33.5 -> 31.9 ms) */
        for (int64_t tok = c0 + PF; tok < c0 + PF + CK && tok < end; tok++) {
            const int64_t slot = table[tok / block_size] * block_size + tok % block_size;
            const int64_t bytes = D * (bf16 ? 2 : 4), off = (slot * kv_heads + kvh) * bytes;
            for (int64_t c = 0; c < bytes; c += 64) {
                __builtin_prefetch((const char *)k_cache + off + c);
                __builtin_prefetch((const char *)v_cache + off + c);
            }
        }
        for (int64_t j = 0; j < nk + 1; j++) { /* the chunk's K and V rows: fp32 kb[j][d], vb[j][d]; or in place */
            const uint16_t *kr = ZERO_ROW, *vr = ZERO_ROW;
            int64_t off = -1;
            if (j < n) {
                const int64_t tok = c0 + j, slot = table[tok / block_size] * block_size + tok % block_size;
                off = (slot * kv_heads + kvh) * D;
                kr = (const uint16_t *)k_cache + off;
                vr = (const uint16_t *)v_cache + off;
            }
            if (pairs) {
                krow[j] = kr;
                if (j % 2 == 0) krow[CK + 2 + j / 2] = vr; /* V rows, paired below */
                else krow[CK + 2 + j / 2 + CK / 2 + 1] = vr;
            } else if (j < nk && off >= 0) { /* (row_f32 converts a bf16 row into kb/vb; fp32 is read in place) */
                kf[j] = row_f32(k_cache, off, D, bf16, kb + j * D);
                vf[j] = row_f32(v_cache, off, D, bf16, vb + j * D);
            } else if (j < nk) {
                kf[j] = vf[j] = ZERO_F32;
            }
        }
        if (pairs)
            for (int64_t jp = 0; jp < npairs; jp++) { /* vp[jp][d] = (v_2jp[d], v_2jp+1[d]) */
                const uint16_t *a = krow[CK + 2 + jp], *b = krow[CK + 2 + jp + CK / 2 + 1];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) vp[jp * D + d] = (uint32_t)a[d] | (uint32_t)b[d] << 16;
            }
        for (int64_t j0 = 0; j0 < nk; j0 += KT) {
            int64_t v = 0;
#if PAIRS
            if (pairs) {
                for (; v + 4 <= nv; v += 4) score_pairs_4(D / 2, qp + 16 * v, nrows, krow, j0, 0, s + j0 * nrows + 16 * v);
                for (; v + 2 <= nv; v += 2) score_pairs_2(D / 2, qp + 16 * v, nrows, krow, j0, 0, s + j0 * nrows + 16 * v);
                for (; v < nv; v++) score_pairs_1(D / 2, qp + 16 * v, nrows, krow, j0, 0, s + j0 * nrows + 16 * v);
            }
#endif
            for (; WIDE && v + 4 <= nv; v += 4) score_4(D, qt + 16 * v, nrows, kf, j0, s + j0 * nrows + 16 * v);
            for (; v + 2 <= nv; v += 2) score_2(D, qt + 16 * v, nrows, kf, j0, s + j0 * nrows + 16 * v);
            for (; v < nv; v++) score_1(D, qt + 16 * v, nrows, kf, j0, s + j0 * nrows + 16 * v);
        }
        /* online softmax over the chunk, VW rows (lanes) at a time; masked keys get p = 0 exactly. A chunk that every
           row of the tile sees whole (all but the last one or two) skips the masks: the same values, with no compare
           per key. With 8-lane vectors on AVX2 (16-lane ones are register pairs there): Zen 3, fp32, one layer, a
           causal 2000-token chunk 87 -> 48 ms, 512 rows over 1500 cached 40 -> 21 ms. */
        const int masked = c0 + n - 1 > start_pos + p0;
        for (int64_t c = 0; c < nrows; c += VW) {
            const vti pc = loadvi(pos + c);
            vt mx = splatv(-3.0e38f);
            for (int64_t j = 0; j < n; j++) {
                const vt sj = loadv(s + j * nrows + c) * s_scale;
                vti more = sj > mx;
                if (masked) more &= (vti){} + (int32_t)(c0 + j) <= pc;
                mx = (vt)(((vti)sj & more) | ((vti)mx & ~more));
            }
            const vt m_old = loadv(m + c);
            const vti up = mx > m_old;
            const vt m_new = (vt)(((vti)mx & up) | ((vti)m_old & ~up));
            const vt alpha = exp_negv(m_old - m_new);
            vt total = (vt){};
            for (int64_t j = 0; j < n; j++) {
                const vt sj = loadv(s + j * nrows + c) * s_scale;
                vt e = exp_negv(sj - m_new);
                if (masked) e = (vt)((vti)e & ((vti){} + (int32_t)(c0 + j) <= pc));
                storev(s + j * nrows + c, e);
                total += e;
            }
            storev(l + c, loadv(l + c) * alpha + total);
            storev(m + c, m_new);
            for (int64_t d = 0; d < D; d++) storev(ot + d * nrows + c, loadv(ot + d * nrows + c) * alpha);
        }
        if (pairs) /* pp[jp][r] = (p[2jp][r], p[2jp+1][r]) rounded to bf16; p = 0 past the chunk */
            for (int64_t v = 0; v < nv; v++)
                for (int64_t jp = 0; jp < npairs; jp++) {
                    const v16f e0 = load16(s + 2 * jp * nrows + 16 * v);
                    const v16f e1 = 2 * jp + 1 < n ? load16(s + (2 * jp + 1) * nrows + 16 * v) : (v16f){};
                    const v16i b0 = (v16i)e0, b1 = (v16i)e1; /* finite, >= 0: round to nearest even */
                    const v16i h0 = (b0 + 0x7fff + ((b0 >> 16) & 1)) >> 16, h1 = (b1 + 0x7fff + ((b1 >> 16) & 1)) >> 16;
                    const v16i packed = (h0 & 0xffff) | (h1 << 16);
                    memcpy(pp + jp * nrows + 16 * v, &packed, 64);
                }
        for (int64_t d0 = 0; d0 < D; d0 += DT) {
            int64_t v = 0;
#if PAIRS
            if (pairs) {
                for (; v + 4 <= nv; v += 4) value_pairs_4(npairs, pp + 16 * v, nrows, vp, d0, D, ot + d0 * nrows + 16 * v);
                for (; v + 2 <= nv; v += 2) value_pairs_2(npairs, pp + 16 * v, nrows, vp, d0, D, ot + d0 * nrows + 16 * v);
                for (; v < nv; v++) value_pairs_1(npairs, pp + 16 * v, nrows, vp, d0, D, ot + d0 * nrows + 16 * v);
            }
#endif
            for (; WIDE && v + 4 <= nv; v += 4) value_4(n, s + 16 * v, nrows, vf, d0, ot + d0 * nrows + 16 * v);
            for (; v + 2 <= nv; v += 2) value_2(n, s + 16 * v, nrows, vf, d0, ot + d0 * nrows + 16 * v);
            for (; v < nv; v++) value_1(n, s + 16 * v, nrows, vf, d0, ot + d0 * nrows + 16 * v);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, h = kvh * group + r % group, off = (p0 + t) * out_stride + h * D;
        const float inv = 1.0f / l[r];
        if (bf16)
            for (int64_t d = 0; d < D; d++) ((uint16_t *)out)[off + d] = bf16_store(ot[d * nrows + r] * inv);
        else
            for (int64_t d = 0; d < D; d++) ((float *)out)[off + d] = ot[d * nrows + r] * inv;
    }
}

/* How many tiles a chunk after a long cached prefix (tiles of equal work, dynamic schedule) is cut into, when its work
   items are few: the count in 1..max_tiles whose slowest thread has the least work, by a cost per item of its
   register-tile passes over the keys (4, 2, 1 row vectors: relative costs 40, 23, 16, and 1 per item; fitted to
   SmolLM2's layers, 4 to 140 rows over 1950 cached, on a 2-core Zen 5: the 16-row vector passes are cheaper per row
   in fours). The first such count wins a tie (fewer, larger tiles). E.g. 80 rows: 2 tiles of 40 positions (120 rows
   each: two 4-vector passes) instead of 3 of 27 (81 rows: 4 + 2 vectors, 9 items on 2 threads): 24.6 vs 29.7 ms. */
static int64_t few_tiles(int64_t q_len, int64_t group, int64_t kv_heads, int nthreads, int64_t max_tiles) {
    int64_t best = 0, best_cost = 0;
    for (int64_t nt = 1; nt <= max_tiles && nt <= q_len; nt++) {
        const int64_t t = (q_len + nt - 1) / nt, real = (q_len + t - 1) / t, nv = (t * group + 15) / 16;
        if (nv > MAXV) continue;
        const int64_t per_item = 1 + 40 * (nv / 4) + 23 * ((nv % 4) / 2) + 16 * (nv % 2);
        const int64_t cost = (real * kv_heads + nthreads - 1) / nthreads * per_item;
        if (best == 0 || cost < best_cost) {
            best = nt; /* (the caller cuts the chunk as here: tiles of t positions, `real` of them) */
            best_cost = cost;
        }
    }
    return best > 0 ? best : max_tiles; /* (max_tiles >= the count the caller started from, which always fits) */
}

/* out[p] = softmax(q[p] K^T * scale, keys 0..start_pos + p) V for the q_len rows of one sequence's chunk.
   q/out: [q_len, heads, D] with row strides q_stride/out_stride (elements); caches [blocks, block_size, kv_heads, D];
   table: the sequence's block ids (int64) covering start_pos + q_len tokens. D % DT == 0, D <= 256. */
int kvchat_prefill_attention(
    const void *q, int64_t q_stride, void *out, int64_t out_stride, int64_t q_len, int64_t start_pos,
    const void *k_cache, const void *v_cache, int64_t block_size, const int64_t *table,
    int64_t heads, int64_t kv_heads, int64_t dim, float scale, int bf16, int nthreads, int64_t rows_per_tile)
{
    const int64_t group = heads / kv_heads;
    if (q_len <= 0) return 0;
    if (group > 16 * MAXV) return -2;
    if (rows_per_tile > 16 * MAXV) rows_per_tile = 16 * MAXV;
    int failed = 0;
    int64_t tq_max = rows_per_tile / group > 0 ? rows_per_tile / group : 1;
    int64_t ntiles = (q_len + tq_max - 1) / tq_max;
    if (WIDE && start_pos >= q_len && ntiles * kv_heads < 8 * nthreads) {
        ntiles = few_tiles(q_len, group, kv_heads, nthreads, ntiles + 2 * nthreads);
    } else if (ntiles * kv_heads < 2 * nthreads) { /* keep every thread busy on short chunks */
        const int64_t want = (2 * nthreads + kv_heads - 1) / kv_heads;
        ntiles = want < q_len ? want : q_len;
    }
    const int64_t tq = (q_len + ntiles - 1) / ntiles;
    ntiles = (q_len + tq - 1) / tq;
    const int64_t nrows = (tq * group + 15) / 16 * 16;

#pragma omp parallel num_threads(nthreads)
    {
        const size_t floats = (size_t)(2 * nrows * dim + (CK + KT) * nrows + 2 * (CK + KT) * dim + dim + CK + 16
                                       + (CK / 2 + 1) * nrows);
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *qt = buf, *ot = qt + nrows * dim, *s = ot + nrows * dim, *kb = s + (CK + KT) * nrows;
        float *vb = kb + (CK + KT) * dim, *tmp = vb + (CK + KT) * dim;
        uint32_t *pp = (uint32_t *)(tmp + dim + CK + 16);
        const uint16_t *krow[2 * CK + 8];
        /* Causal chunk: the last tiles see the most keys, so they go first. A chunk after a long cached prefix has
           tiles of about equal work: kv-head order, so that the threads read the same K/V at the same time (one of
           them from memory, the others from the shared cache). */
        const int by_head = start_pos >= q_len;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntiles * kv_heads; task++) {
            if (!buf) continue;
            const int64_t ti = by_head ? task % ntiles : ntiles - 1 - task / kv_heads;
            const int64_t kvh = by_head ? task / ntiles : task % kv_heads;
            const int64_t p0 = ti * tq, n = q_len - p0 < tq ? q_len - p0 : tq;
#define TILE_ARGS group, kv_heads, kvh, q, q_stride, out, out_stride, p0, n, start_pos, k_cache, v_cache, \
                  block_size, table, scale, qt, ot, s, kb, vb, pp, krow, tmp
            if (dim == 64 && bf16 && PAIRS) tile(64, 1, 1, TILE_ARGS);
            else if (dim == 64 && bf16) tile(64, 1, 0, TILE_ARGS);
            else if (dim == 64) tile(64, 0, 0, TILE_ARGS);
            else if (dim == 128 && bf16 && PAIRS) tile(128, 1, 1, TILE_ARGS);
            else if (dim == 128 && bf16) tile(128, 1, 0, TILE_ARGS);
            else if (dim == 128) tile(128, 0, 0, TILE_ARGS);
            else tile(dim, bf16, bf16 && PAIRS, TILE_ARGS);
#undef TILE_ARGS
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
