"""fp32 matmuls over weights in 16-output panels: ``y = x W^T (+ bias)`` for any number of rows (AVX2/FMA or AVX-512).

Why: on an AVX2 CPU without AVX-512, in fp32 (what ``dtype=auto`` picks there), both ``F.linear`` and the packed GGUF
kernel leave a third of the multiply-add rate unused for the row counts a server runs: ``F.linear`` is built for many
rows, and the packed kernel spends a quarter of its instructions dequantizing. Measured on a 2-core AMD EPYC (Zen 1,
~33 GMAC/s fp32 peak for a large GEMM), SmolLM2's 210 linear layers + LM head per step:

    rows         1      4     16     30     64    512
    panels    25.5   31.2   70.0    120    251   1850 ms
    packed    26.9   42.1   99.4    161      -      - ms   (the Q4/Q8 blocks, ``packed.py``)
    F.linear  42.4    106    178    236    389   2331 ms

Layout: ``panels[p, k, j] = W[16 p + j, k]`` (zeros past the last output), so one 16-output slice of a weight column
is two vector loads. Kernel: the classic outer-product register tile (as in BLIS/GotoBLAS): for each ``k`` a row's
``x[k]`` is broadcast and multiplied into 16 outputs at once; tiles of 6 rows x one panel (12 accumulators), then
4, 2 and 1 rows for the rest of the batch; threads split the panels, and each panel serves every row tile from cache.
Holding the same weights as dense fp32 (no extra memory: it replaces the dense copy), the panels need no
dequantization and no horizontal sums.

Batches of ``BLOCKED_MIN_ROWS`` rows or more (prefill chunks) take a blocked form of the same tiles, as BLIS blocks a
GEMM: k in equal slices of at most 640 (a panel's slice stays in L1/L2 while every row tile of a block uses it), rows
in blocks of 192 (x's slice stays in L2 while the thread's panels pass), partial sums kept in ``y``. Before, every
panel streamed all of ``x`` from L3 or memory: at 2048 rows (a prefill chunk) it took 1.26x ``F.linear``'s time.
Measured on a 2-core AMD EPYC (Zen 3), SmolLM2's linear layers, interleaved rounds, median of the per-round ratios
(``F.linear`` is oneDNN/MKL): blocked / ``F.linear`` 0.84-0.90 at 2048 rows, 0.74 at 256, 0.63 at 32; slices of 256
instead of 640 took 1.15-1.17x as long at 256 and 2048 rows; blocked / plain ~1.0 at 32 and 64 rows but 1.15-1.19 at
16-24 (so smaller batches keep the plain form).

Exactness: every output is summed in one order, whatever the tile, the form or the batch: fused multiply-add chains
over slices of ``KS = 64`` k from zero, added slice by slice (then ``+ bias``), so a row gives the same bits alone and
in any batch (test); results differ from ``F.linear`` only by summation order. (The slices: one chain over all k put
SmolLM2's fp32 logits 1.14e-4 from transformers', past the 1e-4 the tests allow; by slices 4.8e-5, and 2.2e-5 from a
float64 forward, against transformers' own 9.3e-5.)

Built and used on x86 CPUs with AVX2 and FMA; elsewhere the dense and packed paths stay. With AVX-512 a panel's 16
outputs at one ``k`` are one 16-lane register instead of two 8-lane ones (written so: gcc kept the AVX2 form's
8-lane pairs apart, 1.4x slower from 16 rows on); each output still sums in the order above, so the bits are those
of an AVX2 build (test). On AVX-512 CPUs the panels also take fp32 from the GGUF blocks and ``F.linear``, which gave
one- and two-row batches other bits than larger ones. Measured on a 2-core Zen 5 EPYC, SmolLM2's linear layers +
head, fp32 (ms, 16-lane / 8-lane form): interleaved, best of 9, 1 row 12.0 / 12.0 (memory-bound), 16 rows 14.0 /
19.7, 64 rows 54.7 / 78.9; in separate runs, best of 5, with ``F.linear`` third: 1 row 11.6 / 8.6 / 31.9, 16 rows
14.5 / 20.4 / 46.3, 256 rows 198 / 290 / 365, 2048 rows 1584 / 2358 / 2760.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from engine.device import cpu_flags
from engine.model.cpu_kernels import open_library

PANEL = 16  # outputs per panel (two 8-lane vectors)
BLOCKED_MIN_ROWS = 32  # batches of this many rows or more take the blocked form (k slices x row blocks)

# NOTE: the panels serve every batch size, also the one or two rows where the GGUF blocks (packed.py, ~6x fewer bytes)
# were read before: those gave such batches other bits than larger ones (fp32 sums in another order), so a request's
# output could change with the batch it ran in, or with a prefix-cache hit (a fully cached prompt recomputes one row).
# What that cost: SmolLM2's linear layers + head at one row, Zen 3, interleaved: 19.5 vs 16.1 ms (best), 1.09x (median
# ratio); at two rows 1.19x (Zen 1 before: 45 vs 40 ms and 54 vs 48 ms for the whole step).

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

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
TILE(4)
TILE(2)
TILE(1)

/* The row tiles of rows r .. END - 1 (r advances): as many of 6 rows as fit, then one of 4, 2 and 1 as needed. X(MR)
   runs one tile of MR rows at row r and advances r. */
#define ROW_TILES(END, X)                                                                                     \
    do {                                                                                                      \
        while (r + 6 <= (END)) X(6);                                                                          \
        if (r + 4 <= (END)) X(4);                                                                             \
        if (r + 2 <= (END)) X(2);                                                                             \
        if (r < (END)) X(1);                                                                                  \
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
BTILE(4)
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
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t lo = npanels * tid / nth, hi = npanels * (tid + 1) / nth; /* (static split, contiguous) */
        for (int64_t p = lo; p < hi; p++) {
            float c[6 * 16];
            const float *pan = panels + p * K * 16, *pf = p + 1 < hi ? pan + K * 16 : pan;
            const int64_t lines = p + 1 < hi ? K : 0;
            int64_t r = 0, done = 0; /* rows done; next-panel lines prefetched so far (lines * r / R) */
#define TILE_AT(MR)                                                                                           \
    do {                                                                                                      \
        const int64_t from = done;                                                                            \
        done = lines * (r + MR) / R;                                                                          \
        tile_##MR(x + r * K, K, pan, c, pf, from, done);                                                      \
        put(c, MR, r, p, O, bias, y);                                                                         \
        r += MR;                                                                                              \
    } while (0)
            ROW_TILES(R, TILE_AT);
#undef TILE_AT
        }
    }
}
"""


@dataclass(frozen=True, slots=True)
class PanelWeight:
    """A linear weight ``[out, in]`` held as fp32 panels ``[ceil(out / 16), in, 16]`` (zeros past ``out``)."""

    panels: torch.Tensor
    out_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.panels.shape[1]))

    @property
    def dense(self) -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor (a new copy)."""
        n, k = self.panels.shape[0], self.panels.shape[1]
        return self.panels.permute(0, 2, 1).reshape(n * PANEL, k)[: self.out_features].contiguous()


def to_panels(weight: torch.Tensor) -> PanelWeight:
    """``weight`` (``[out, in]``, fp32) as panels."""
    out_features, in_features = weight.shape
    n = -(-out_features // PANEL)
    padded = torch.zeros(n * PANEL, in_features, dtype=torch.float32, device=weight.device)
    padded[:out_features] = weight
    panels = padded.view(n, PANEL, in_features).transpose(1, 2).contiguous()
    return PanelWeight(panels, out_features)


@functools.cache
def available() -> bool:
    """Whether this CPU is one the kernel is built and used for: x86 with AVX2 and FMA (AVX-512 or not)."""
    return {"avx2", "fma"} <= cpu_flags()


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where ``available()`` is False, kernels are disabled or the build fails."""
    if not available():
        return None
    lib = open_library("panel_linear", _SOURCE, "the dense and packed weights")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of a built kernel library's functions (``load``; tests build variants)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.kvchat_panel_linear, lib.kvchat_panel_linear_blocked):
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
        fn.restype = None
    return lib


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dense, bias)`` for fp32 CPU ``x`` ``[rows, in]``."""
    rows, in_features = x.shape
    if x.dtype != torch.float32 or in_features != weight.panels.shape[1]:
        raise ValueError(
            f"panel weight [{weight.out_features}, {weight.panels.shape[1]}] cannot take {x.dtype} "
            f"input of shape {tuple(x.shape)}"
        )
    xc = x.contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    blocked = rows >= BLOCKED_MIN_ROWS
    out = weight.out_features
    width = weight.panels.shape[0] * PANEL if blocked else out  # (the blocked form writes whole panels, padding too)
    if bf is not None and width != out:
        bf = torch.cat([bf, bf.new_zeros(width - out)])
    y = torch.empty((rows, width), dtype=torch.float32)
    kernel = lib.kvchat_panel_linear_blocked if blocked else lib.kvchat_panel_linear
    kernel(
        xc.data_ptr(),
        rows,
        in_features,
        weight.panels.data_ptr(),
        out,
        None if bf is None else bf.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y if width == out else y[:, :out].contiguous()
