#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>
#include <sys/syscall.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when this process may use the tile registers (asked once; later calls are no-ops for the kernel) */
int kvchat_amx_init(void) {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask)) return -2;
    return (mask & (1UL << XFEATURE_XTILEDATA)) ? 0 : -3;
}

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: accumulators (rows x 16 fp32); 4-5: x (rows x 32 bf16); 6-7: weights (16 pairs x 16 outputs) */
static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = (uint8_t)(t < 6 ? rows : 16); c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

#include "bf16_put.h"

/* (put() above reads a stored accumulator tile, 16 floats a row, 64-byte aligned, as its rows of 16-lane vectors) */

/* up to 16 rows, x read in place: panels [lo, hi), four at a time */
static void few_rows(const uint16_t *x, const int R, const int64_t K, const uint16_t *panels, const int64_t lo,
                     const int64_t hi, const int64_t O, const float *bias, uint16_t *y, float (*acc)[256]) {
    const int64_t chunks = K / 32, ps = K * 16; /* (a panel: K / 2 lines of 32 bf16) */
    configure(R);
    int64_t p = lo;
    for (; p + 4 <= hi; p += 4) {
        const uint16_t *w = panels + p * ps;
        /* NOTE: no software prefetch of the next group: prefetching it into L2, spread over this group's chunks,
           measured no faster for 16 rows (16 x 1k step, interleaved, medians of 8: 12.5 vs 12.9 ms) and slower for
           one (10.5 vs 9.1 ms); the four panels are four sequential streams for the hardware prefetcher. */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, x + 32 * c, K * 2);
            _tile_loadd(6, w + 512 * c, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w + ps + 512 * c, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, w + 2 * ps + 512 * c, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, w + 3 * ps + 512 * c, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
        for (int j = 0; j < 4; j++) put((const __m512 *)acc[j], R, 0, p + j, O, bias, y);
    }
    for (; p < hi; p++) {
        const uint16_t *w = panels + p * ps;
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, x + 32 * c, K * 2);
            _tile_loadd(6, w + 512 * c, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, acc[0], 64);
        put((const __m512 *)acc[0], R, 0, p, O, bias, y);
    }
}

/* more rows, x as 16 x 32 blocks (xb: [row block][chunk][16][32]): 32 rows x 2 panels at a time over row chunks
   of mc rows */
static void many_rows(const uint16_t *xb, const int64_t R, const int64_t K, const uint16_t *panels, const int64_t lo,
                      const int64_t hi, const int64_t O, const float *bias, uint16_t *y, float (*acc)[256]) {
    const int64_t chunks = K / 32, ps = K * 16;
    int64_t mc = (1 << 20) / (K * 2) / 32 * 32;
    if (mc < 32) mc = 32;
    configure(16);
    for (int64_t rc = 0; rc < R; rc += mc)
        for (int64_t p = lo; p < hi; p += 2) {
            const int two = p + 1 < hi;
            const uint16_t *w0 = panels + p * ps, *w1 = two ? w0 + ps : w0;
            for (int64_t r0 = rc; r0 < R && r0 < rc + mc; r0 += 32) {
                const uint16_t *xa = xb + (r0 / 16) * chunks * 512, *xc = xa + chunks * 512;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, xa + 512 * c, 64);
                    _tile_loadd(6, w0 + 512 * c, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, w1 + 512 * c, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, xc + 512 * c, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64);
                _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
                const int64_t left = R - r0;
                const int n0 = left < 16 ? (int)left : 16, n1 = left <= 16 ? 0 : (left < 32 ? (int)left - 16 : 16);
                put((const __m512 *)acc[0], n0, r0, p, O, bias, y);
                if (two) put((const __m512 *)acc[1], n0, r0, p + 1, O, bias, y);
                if (n1) put((const __m512 *)acc[2], n1, r0 + 16, p, O, bias, y);
                if (n1 && two) put((const __m512 *)acc[3], n1, r0 + 16, p + 1, O, bias, y);
            }
        }
}

/* y[R][O] = x[R][K] . W^T (+ bias), W as pair panels [ceil(O / 16)][K / 2][16][2]; K a multiple of 32, R >= 1.
   Returns -1 when out of memory for the copy of x (R > 16 only), else 0. */
int kvchat_amx_panels(const uint16_t *x, int64_t R, int64_t K, const uint16_t *panels, int64_t O,
                      const float *bias, uint16_t *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16, chunks = K / 32, blocks = (R + 31) / 32 * 2;
    uint16_t *xb = NULL;
    if (R > 16) {
        xb = (uint16_t *)aligned_alloc(64, (size_t)(blocks * chunks * 1024));
        if (!xb) return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float acc[4][256] __attribute__((aligned(64)));
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t lo = npanels * tid / nth, hi = npanels * (tid + 1) / nth;
        if (R <= 16) {
            few_rows(x, (int)R, K, panels, lo, hi, O, bias, y, acc);
        } else {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                for (int64_t c = 0; c < chunks; c++)
                    for (int64_t i = 0; i < 16; i++) {
                        uint16_t *dst = xb + ((b * chunks + c) * 16 + i) * 32;
                        if (b * 16 + i < R) memcpy(dst, x + (b * 16 + i) * K + 32 * c, 64);
                        else memset(dst, 0, 64);
                    }
            /* (the loop's barrier: every block is copied before any thread reads them) */
            many_rows(xb, R, K, panels, lo, hi, O, bias, y, acc);
        }
        _tile_release();
    }
    free(xb);
    return 0;
}
