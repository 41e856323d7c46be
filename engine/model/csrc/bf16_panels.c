#include "prelude.h"

#include <immintrin.h>
#include <omp.h>

/* acc[r] = x_r . panel column (16 outputs) for RT rows: one vdpbf16ps chain per row over the input pairs, from zero.
   Meanwhile it prefetches lines [pf_lo, pf_hi) of the next panel (line kp holds input pair kp), spread evenly. */
#define TILE(RT)                                                                                              \
static inline __attribute__((always_inline)) void tile_##RT(const uint32_t *x, const int64_t pairs,           \
                                                            const uint16_t *pan, const uint16_t *pf,          \
                                                            int64_t pf_lo, const int64_t pf_hi, __m512 *out) { \
    __m512 acc[RT];                                                                                           \
    for (int r = 0; r < RT; r++) acc[r] = _mm512_setzero_ps();                                                \
    const int64_t count = pf_hi - pf_lo;                                                                      \
    int64_t due = 0; /* count / pairs lines per pair, as a running remainder */                               \
    for (int64_t kp = 0; kp < pairs; kp++) {                                                                  \
        if (count == pairs) /* (one tile takes every line: the next panel's line kp) */                       \
            _mm_prefetch((const char *)(pf + 32 * (pf_lo + kp)), _MM_HINT_T1);                                \
        else                                                                                                  \
            for (due += count; due >= pairs; due -= pairs)                                                    \
                _mm_prefetch((const char *)(pf + 32 * pf_lo++), _MM_HINT_T1);                                 \
        const __m512bh w = (__m512bh)_mm512_loadu_si512(pan + 32 * kp);                                       \
        for (int r = 0; r < RT; r++)                                                                          \
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int32_t)x[r * pairs + kp]), w);    \
    }                                                                                                         \
    for (int r = 0; r < RT; r++) out[r] = acc[r];                                                             \
}
TILE(16)
TILE(8)
TILE(7)
TILE(6)
TILE(5)
TILE(4)
TILE(3)
TILE(2)
TILE(1)

#include "bf16_put.h"
#include "panel_loop.h"

#define ROWS 6
#define GROUP 4
/* From this many rows (a prefill chunk, a large batch) the grouped tiles run; below, one panel at a time with row
   tiles of up to 16, which keeps the panel in L1 and spreads the next panel's prefetch over the tiles. SmolLM2's
   linear layers, bf16, 2 threads, Zen 4 (best of 5, 3 interleaved rounds): grouped 58-62 ms vs 65-74 at 108 rows,
   272-277 vs 297-318 at 512; at 1-32 rows the panel loop is as fast or faster (1 row: 7.1-9.9 vs 9.8-10.4 ms). */
#define GROUPED_ROWS 64

/* Register tiles of G panels (16 outputs each) x RT rows: per input pair, G panel lines and RT broadcasts of x feed
   G x RT vdpbf16ps, so a line of x or of the weights is loaded once for several products (G = 4, RT = 6: 24
   accumulators, 4 weight lines and a broadcast, 29 of the 32 registers; 10 loads per 24 products, where a tile of
   one panel needs 17 per 16). Each output is still one vdpbf16ps chain over the input pairs in order, from zero, so
   a row gets the same bits in any tile, alone or in any batch. While `fetch`, it prefetches the next group's lines
   into L2, line kp of each of its panels at step kp (each panel has `pairs` lines): one row block of a few rows (a
   decode step) would stream the weights with G x RT chains in flight, but measured slower than the panel loop there:
   GROUPED_ROWS). */
#define GTILE(RT, G)                                                                                           \
static inline __attribute__((always_inline)) void gtile_##RT##_##G(const uint32_t *x, const int64_t pairs,     \
                                                                  const uint16_t *pan, const uint16_t *pf,    \
                                                                  const int fetch, __m512 (*out)[ROWS]) {     \
    __m512 acc[G][RT];                                                                                        \
    for (int g = 0; g < G; g++)                                                                               \
        for (int r = 0; r < RT; r++) acc[g][r] = _mm512_setzero_ps();                                         \
    for (int64_t kp = 0; kp < pairs; kp++) {                                                                  \
        if (fetch)                                                                                            \
            for (int g = 0; g < G; g++) _mm_prefetch((const char *)(pf + (g * pairs + kp) * 32), _MM_HINT_T1); \
        __m512bh w[G];                                                                                        \
        for (int g = 0; g < G; g++) w[g] = (__m512bh)_mm512_loadu_si512(pan + (g * pairs + kp) * 32);        \
        for (int r = 0; r < RT; r++) {                                                                        \
            const __m512bh xr = (__m512bh)_mm512_set1_epi32((int32_t)x[r * pairs + kp]);                     \
            for (int g = 0; g < G; g++) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], xr, w[g]);                    \
        }                                                                                                     \
    }                                                                                                         \
    for (int g = 0; g < G; g++)                                                                               \
        for (int r = 0; r < RT; r++) out[g][r] = acc[g][r];                                                   \
}
#define GTILES(RT) GTILE(RT, GROUP) GTILE(RT, 1)
GTILES(6)
GTILES(5)
GTILES(4)
GTILES(3)
GTILES(2)
GTILES(1)

/* One group of g panels (GROUP or 1) from panel p over all R rows, ROWS at a time; the first row block prefetches
   the next group's lines (pf; fetch: there is a next group in this thread's run). */
static void group_rows(const uint32_t *x32, const int64_t R, const int64_t pairs, const uint16_t *pan,
                       const uint16_t *pf, int fetch, const int64_t g, const int64_t p, const int64_t O,
                       const float *bias, uint16_t *y) {
    __m512 acc[GROUP][ROWS];
    for (int64_t r = 0; r < R; r += ROWS, fetch = 0) {
        const int64_t rt = R - r < ROWS ? R - r : ROWS;
        const uint32_t *x = x32 + r * pairs;
#define TILE_CALL(RT)                                                                                          \
        if (g == GROUP) gtile_##RT##_##GROUP(x, pairs, pan, pf, fetch, acc);                                    \
        else gtile_##RT##_1(x, pairs, pan, pf, fetch, acc)
        switch (rt) {
            case 1: TILE_CALL(1); break;
            case 2: TILE_CALL(2); break;
            case 3: TILE_CALL(3); break;
            case 4: TILE_CALL(4); break;
            case 5: TILE_CALL(5); break;
            default: TILE_CALL(6); break;
        }
#undef TILE_CALL
        for (int64_t i = 0; i < g; i++) put(acc[i], (int)rt, r, p + i, O, bias, y);
    }
}


/* y[R][O] = x[R][K] . W^T (+ bias) with W as pair panels [ceil(O / 16)][K / 2][16][2]; K even. Threads split the
   panels (contiguous runs, so each knows its next panel or group to prefetch); below GROUPED_ROWS row tiles share
   each panel's lines, from it groups of GROUP panels (the run's rest one by one) take every row, ROWS at a time. */
void kvchat_bf16_panels(const uint16_t *x, int64_t R, int64_t K, const uint16_t *panels, int64_t O,
                        const float *bias, uint16_t *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16, pairs = K / 2;
    const uint32_t *x32 = (const uint32_t *)x;
#define TILE_CALL(RT, from, to) tile_##RT(x32 + r * pairs, pairs, pan, pf, from, to, acc)
/* Row tiles of a panel: 16 rows at a time, then what is left in at most two tiles of 5-8 rows or one of fewer.
   Each row of a tile is one vdpbf16ps chain (latency 6 cycles on Zen 4), so a tile of 1, 2 or 4 rows waits on its
   chains where 5-8 rows keep the unit busy: 7 rows as 4 + 2 + 1 took 12.7 ms for SmolLM2's linears, as one tile
   9.3 (13 rows: 14.9 -> 10.7; 16, 24, 40 rows unchanged; bf16, 2 threads, Zen 4). A draft verification's rows. */
#define BF16_ROW_TILES                                                                                        \
    while (r + 16 <= R) TILE_AT(16);                                                                          \
    if (r + 8 < R) { /* 9-15 rows left: two tiles of 5-8 */                                                   \
        switch ((R - r + 1) / 2) {                                                                            \
            case 8: TILE_AT(8); break;                                                                        \
            case 7: TILE_AT(7); break;                                                                        \
            case 6: TILE_AT(6); break;                                                                        \
            default: TILE_AT(5); break;                                                                       \
        }                                                                                                     \
    }                                                                                                         \
    switch (R - r) { /* 0-8 rows left: one tile */                                                            \
        case 8: TILE_AT(8); break;                                                                            \
        case 7: TILE_AT(7); break;                                                                            \
        case 6: TILE_AT(6); break;                                                                            \
        case 5: TILE_AT(5); break;                                                                            \
        case 4: TILE_AT(4); break;                                                                            \
        case 3: TILE_AT(3); break;                                                                            \
        case 2: TILE_AT(2); break;                                                                            \
        case 1: TILE_AT(1); break;                                                                            \
        default: break;                                                                                       \
    }
    if (R >= GROUPED_ROWS) {
#pragma omp parallel num_threads(nthreads)
        {
            const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            const int64_t lo = npanels * tid / nth, hi = npanels * (tid + 1) / nth, size = pairs * 32;
            for (int64_t p = lo; p < hi;) {
                const int64_t g = hi - p >= GROUP ? GROUP : 1, next = p + g;
                const int64_t next_g = hi - next >= GROUP ? GROUP : 1; /* (the next group's size, where there is one) */
                const uint16_t *pan = panels + p * size, *pf = panels + next * size;
                group_rows(x32, R, pairs, pan, pf, next + next_g <= hi && next_g == g, g, p, O, bias, y);
                p = next;
            }
        }
        return;
    }
#pragma omp parallel num_threads(nthreads)
    PANEL_LOOP(uint16_t, __m512 acc[16], panels, npanels, pairs * 32, pairs, BF16_ROW_TILES);
}
