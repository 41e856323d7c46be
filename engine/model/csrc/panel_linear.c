#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>
#include "panel_loop.h"

/* A panel's 16 outputs at one k are NV vectors of VL lanes: one 16-lane vector with AVX-512, two 8-lane ones with
   AVX2. Either way each output is summed in its own lane, in the one order below, so both builds give the same bits. */
#ifdef __AVX512F__
typedef __m512 vec;
#define NV 1
#define VL 16
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#else
typedef __m256 vec;
#define NV 2
#define VL 8
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#endif

/* one k of a tile: acc[r] += x[r][k] * the panel's 16 values at k, for MR rows (x rows K apart) */
#define FMA_K(MR, k)                                                                                          \
    do {                                                                                                      \
        vec b[NV];                                                                                            \
        for (int v = 0; v < NV; v++) b[v] = V_LOAD(pan + (k) * 16 + v * VL);                                  \
        for (int r = 0; r < (MR); r++) {                                                                      \
            const vec a = V_BCAST(x + r * K + (k));                                                           \
            for (int v = 0; v < NV; v++) acc[r][v] = V_FMA(a, b[v], acc[r][v]);                               \
        }                                                                                                     \
    } while (0)

/* The sum over k: each output is a chain of sums of slices, (s_0 + s_1) + s_2 + ..., where s_i is one fma chain over
   k = KS i .. KS (i + 1) - 1 from zero. In any batch, tile and form an output is summed in this one order (so a row
   gives the same bits alone and in a batch), and the rounding error grows with KS + K / KS instead of K: SmolLM2's
   fp32 logits were 1.14e-4 from transformers' with one chain over k (the down projection's 1536), 4e-5 with its
   down projection in fp64. */
#ifndef KS
#define KS 64
#endif

/* c[r][j] = x_r . panel column j for MR rows, summed by slices as above (each slice's chain in registers, the running
   sum in c). (Written this way, gcc keeps the MR NV accumulators in registers; more general forms, [MR][NP][2]
   arrays or several panels, got them spilled to the stack on every step.) Meanwhile it prefetches lines
   [pf_lo, pf_hi) of the next panel (one line is one k of a panel), spread evenly over its k. */
#define TILE(MR)                                                                                              \
static inline __attribute__((always_inline)) void tile_##MR(const float *x, int64_t K, const float *pan,     \
                                                            float *c, const float *pf, int64_t pf_lo,         \
                                                            int64_t pf_hi) {                                  \
    vec acc[MR][NV];                                                                                          \
    const int64_t count = pf_hi - pf_lo; /* (fixed: with pf_lo as it advances, 63% of them were fetched) */  \
    int64_t due = 0; /* count / K lines per k, as a running remainder */                                     \
    for (int64_t k0 = 0; k0 < K; k0 += KS) {                                                                  \
        const int64_t k1 = k0 + KS < K ? k0 + KS : K;                                                         \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int v = 0; v < NV; v++) acc[r][v] = V_ZERO();                                                \
        for (int64_t k = k0; k < k1; k++) {                                                                   \
            due += count;                                                                                     \
            for (; due >= K; due -= K) __builtin_prefetch(pf + 16 * pf_lo++, 0, 2);                         \
            FMA_K(MR, k);                                                                                     \
        }                                                                                                     \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int v = 0; v < NV; v++) {                                                                    \
                float *at = c + r * 16 + v * VL;                                                              \
                V_STORE(at, k0 ? V_ADD(V_LOAD(at), acc[r][v]) : acc[r][v]);                                   \
            }                                                                                                 \
    }                                                                                                         \
}
TILE(6)
TILE(5)
TILE(4)
TILE(3)
TILE(2)
TILE(1)

/* The row tiles of rows r .. END - 1 (r advances): as many of 6 rows as fit, then the rest in one tile (7 rows: 4 +
   3), not 4 + 2 + 1: a tile of 1 or 2 rows waits on its few FMA chains (fp32, AVX-512, Zen 4, SmolLM2's linears:
   9 rows 21.3 -> 19.8 ms, 11 rows 21.1 -> 19.2; the same bits). X(MR) runs one tile of MR rows at row r and
   advances r. */
#define ROW_TILES(END, X)                                                                                     \
    do {                                                                                                      \
        while ((END) - r >= 6 && (END) - r != 7) X(6);                                                        \
        if ((END) - r == 7) X(4);                                                                             \
        switch ((END) - r) {                                                                                  \
            case 5: X(5); break;                                                                              \
            case 4: X(4); break;                                                                              \
            case 3: X(3); break;                                                                              \
            case 2: X(2); break;                                                                              \
            case 1: X(1); break;                                                                              \
            default: break;                                                                                   \
        }                                                                                                     \
    } while (0)

/* The blocked form for many rows (prefill chunks), as BLIS/GotoBLAS block a GEMM: k in slices of up to KC (a
   panel's slice, up to 40 KiB, stays in L1/L2 while every row tile of a row block uses it; a multiple of KS, so that
   the sums by slices above fall within one) and rows in blocks of MC (x's MC x KC slice stays in L2 while the
   thread's panels pass). A tile adds its slices to the running sums it left in y (stored and reloaded as fp32:
   exact), so every output is summed in the order above, then + bias: the same bits as the tiles above. */
#ifndef KC
#define KC 640 /* K is cut into equal slices of at most KC (576: whole, 1536: 3 x 512); 256 measured 1.17x slower */
#endif
#ifndef MC
#define MC 192
#endif
#define BTILE(MR)                                                                                             \
static inline __attribute__((always_inline)) void btile_##MR(const float *x, int64_t K, int64_t kc,           \
                                                             const float *pan, float *y, int64_t ldy,         \
                                                             int first, const float *bias) {                  \
    vec acc[MR][NV];                                                                                          \
    for (int64_t k0 = 0; k0 < kc; k0 += KS) {                                                                 \
        const int64_t k1 = k0 + KS < kc ? k0 + KS : kc;                                                       \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int v = 0; v < NV; v++) acc[r][v] = V_ZERO();                                                \
        for (int64_t k = k0; k < k1; k++) FMA_K(MR, k);                                                       \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int v = 0; v < NV; v++) {                                                                    \
                float *at = y + r * ldy + v * VL;                                                             \
                vec sum = first && k0 == 0 ? acc[r][v] : V_ADD(V_LOAD(at), acc[r][v]);                        \
                if (bias && k1 == kc) sum = V_ADD(sum, V_LOAD(bias + v * VL));                                \
                V_STORE(at, sum);                                                                             \
            }                                                                                                 \
    }                                                                                                         \
}
BTILE(6)
BTILE(5)
BTILE(4)
BTILE(3)
BTILE(2)
BTILE(1)

/* y[R][ldy] (ldy = 16 x panels: the padding outputs are written too) = x . W^T (+ bias, padded to ldy) */
void kvchat_panel_linear_blocked(const float *x, int64_t R, int64_t K, const float *panels, int64_t O,
                                 const float *bias, float *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16, ldy = npanels * 16;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t lo = npanels * tid / nth, hi = npanels * (tid + 1) / nth;
        const int64_t slices = (K + KC - 1) / KC, even = (K + slices - 1) / slices, step = (even + KS - 1) / KS * KS;
        for (int64_t k0 = 0; k0 < K; k0 += step) {
            const int64_t kc = K - k0 < step ? K - k0 : step;
            const int first = k0 == 0;
            const float *bk = k0 + kc >= K ? bias : NULL;
            for (int64_t i0 = 0; i0 < R; i0 += MC) {
                const int64_t i1 = i0 + MC < R ? i0 + MC : R;
                for (int64_t p = lo; p < hi; p++) {
                    const float *pan = panels + p * K * 16 + k0 * 16, *bp = bk ? bk + p * 16 : NULL;
                    const int64_t lines = p + 1 < hi ? kc : 0; /* the next panel's slice, fetched meanwhile */
                    int64_t r = i0, done = 0;
#define BT(MR)                                                                                                \
    do {                                                                                                      \
        for (const int64_t due = lines * (r + MR - i0) / (i1 - i0); done < due; done++)                      \
            __builtin_prefetch(pan + K * 16 + done * 16, 0, 2);                                               \
        btile_##MR(x + r * K + k0, K, kc, pan, y + r * ldy + p * 16, ldy, first, bp);                         \
        r += MR;                                                                                              \
    } while (0)
                    ROW_TILES(i1, BT);
#undef BT
                }
            }
        }
    }
}

/* rows r0 .. r0 + mr of y for panel p (+ bias), from the tile's results c */
static inline void put(const float *c, int mr, int64_t r0, int64_t p, int64_t O, const float *bias, float *y) {
    const int64_t o0 = p * 16, n = O - o0 < 16 ? O - o0 : 16;
    for (int r = 0; r < mr; r++) {
        float *dst = y + (r0 + r) * O + o0;
        for (int64_t j = 0; j < n; j++) dst[j] = c[r * 16 + j] + (bias ? bias[o0 + j] : 0.0f);
    }
}

/* y[R][O] = x[R][K] . W^T (+ bias) with W as panels [ceil(O / 16)][K][16]; threads split the panels, and each
   panel (read from memory once) serves every row tile from cache. While a thread computes one panel it prefetches
   its next one into L2, each row tile a share of its lines in proportion to the tile's rows, so that the memory
   reads overlap every tile's arithmetic instead of stalling the first tile (which otherwise streams its panel from
   memory at the rate its multiply-adds would need). */
void kvchat_panel_linear(const float *x, int64_t R, int64_t K, const float *panels, int64_t O, const float *bias,
                         float *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16;
#define TILE_CALL(MR, from, to) tile_##MR(x + r * K, K, pan, acc, pf, from, to)
#pragma omp parallel num_threads(nthreads)
    PANEL_LOOP(float, float acc[6 * 16], panels, npanels, K * 16, K, ROW_TILES(R, TILE_AT));
}
