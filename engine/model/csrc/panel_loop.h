/* The panel loop of both panel kernels (bf16_panels.c, panel_linear.c). Threads take contiguous runs of panels (a
   static split), so each knows its next panel and prefetches it into L2 while it computes this one: each row tile a
   share of its lines in proportion to the tile's rows, so that memory reads overlap every tile's arithmetic. */
#ifndef KVCHAT_PANEL_LOOP_H
#define KVCHAT_PANEL_LOOP_H
#include <stdint.h>
#include <omp.h>

/* For each panel p of this thread's run: `pan` (its panel_size elements), `pf` (the next panel's; itself for the
   last, with no lines to fetch), then ROW_TILES over its R rows with `acc` (ACC_DECL) for the tile's results. */
#define PANEL_LOOP(ELEM, ACC_DECL, panels, npanels, panel_size, panel_lines, ROW_TILES)                          \
    do {                                                                                                         \
        const int tid_ = omp_get_thread_num(), nth_ = omp_get_num_threads();                                     \
        const int64_t lo_ = (npanels) * tid_ / nth_, hi_ = (npanels) * (tid_ + 1) / nth_;                        \
        for (int64_t p = lo_; p < hi_; p++) {                                                                    \
            ACC_DECL;                                                                                            \
            const ELEM *pan = (panels) + p * (panel_size), *pf = p + 1 < hi_ ? pan + (panel_size) : pan;         \
            const int64_t lines = p + 1 < hi_ ? (panel_lines) : 0;                                               \
            int64_t r = 0, done = 0; /* rows done; next-panel lines prefetched so far (lines * r / R) */         \
            ROW_TILES;                                                                                           \
        }                                                                                                        \
    } while (0)

/* In ROW_TILES: a tile of RT rows at row r; TILE_CALL(RT, from, to) computes it into acc and prefetches the next
   panel's lines [from, to); then put() writes its outputs. */
#define TILE_AT(RT)                                                                                              \
    do {                                                                                                         \
        const int64_t from_ = done;                                                                              \
        done = lines * (r + (RT)) / R;                                                                           \
        TILE_CALL(RT, from_, done);                                                                              \
        put(acc, RT, r, p, O, bias, y);                                                                          \
        r += (RT);                                                                                               \
    } while (0)

#endif
