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
TILE(4)
TILE(2)
TILE(1)

#include "bf16_put.h"
#include "panel_loop.h"


/* y[R][O] = x[R][K] . W^T (+ bias) with W as pair panels [ceil(O / 16)][K / 2][16][2]; K even. Threads split the
   panels (contiguous runs, so each knows its next one to prefetch), row tiles share each panel's lines. */
void kvchat_bf16_panels(const uint16_t *x, int64_t R, int64_t K, const uint16_t *panels, int64_t O,
                        const float *bias, uint16_t *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16, pairs = K / 2;
    const uint32_t *x32 = (const uint32_t *)x;
#define TILE_CALL(RT, from, to) tile_##RT(x32 + r * pairs, pairs, pan, pf, from, to, acc)
#define BF16_ROW_TILES                                                                                        \
    while (r + 16 <= R) TILE_AT(16);                                                                          \
    if (r + 8 <= R) TILE_AT(8);                                                                               \
    if (r + 4 <= R) TILE_AT(4);                                                                               \
    if (r + 2 <= R) TILE_AT(2);                                                                               \
    if (r < R) TILE_AT(1)
#pragma omp parallel num_threads(nthreads)
    PANEL_LOOP(uint16_t, __m512 acc[16], panels, npanels, pairs * 32, pairs, BF16_ROW_TILES);
}
