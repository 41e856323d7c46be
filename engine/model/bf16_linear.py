"""Few-row bf16 matmuls with AVX512-BF16 (``vdpbf16ps``): ``y = x W^T (+ bias)`` for a batch of up to
``MAX_ROWS`` rows over a model's dense bf16 weights.

Why: oneDNN's bf16 GEMM (what ``F.linear`` runs) is built for many rows. With 16-30 rows, SmolLM2's linear layers
get ~60-90 GMAC/s out of it on a 2-core AVX512-BF16 CPU whose peak is ~200 (a decode step of 16 streams: 36 ms; a
30-token follow-up: 37 ms). Here every output is a dot product over the input dim taken 32 bf16 values at a time
(one ``vdpbf16ps`` per row/output pair and step, straight from the row-major weights: no packed copy), in register
tiles of 4 rows x 4 outputs (2 x 8, 1 x 16 for fewer rows) whose 16 accumulators are summed by one transpose-reduce.
Work is split by blocks of 16 outputs; within one, each tile of outputs is read from memory once (its first row
tiles also prefetch, into L2, the weights 16 outputs on, one output row each: a steady stream at ~36 GB/s for one
row instead of ~11) and stays in L1 while the other row tiles pass over it.

A row's result depends only on that row and the weights (fixed summation order), so it is the same in any batch of
up to ``MAX_ROWS`` rows. Only built and used where the CPU has AVX512-BF16; elsewhere ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.device import cpu_flags
from engine.model.cpu_kernels import C_PRELUDE, open_library

# NOTE: SmolLM2's linear layers + LM head per step, bf16, 2 threads (AVX512-BF16, no AMX), kernel vs oneDNN:
# 1 row 7.4 vs 22 ms, 16: 16 vs 33, 30: 32 vs 42, 64: 56 vs 72, 96: 79 vs 92. Larger batches (prefill chunks) keep
# oneDNN, whose blocking is made for them.
MAX_ROWS = 96

_SOURCE = (
    C_PRELUDE
    + r"""
#include <immintrin.h>

/* out16[i * OT + j] = x_{r0+i} . w_{o0+j} for RT rows and OT = 16 / RT outputs (clamped to the last output) */
#define TILE(RT)                                                                                                \
    static inline __attribute__((always_inline)) void tile_##RT(const uint16_t *x, int64_t K, const uint16_t *w, \
        int64_t O, int64_t o0, unsigned prefetch, float *restrict out16) {                                       \
        enum { OT = 16 / RT };                                                                                   \
        __m512 acc[RT][OT];                                                                                      \
        const uint16_t *wr[OT];                                                                                  \
        for (int j = 0; j < OT; j++) wr[j] = w + (o0 + j < O ? o0 + j : O - 1) * K;                              \
        for (int i = 0; i < RT; i++)                                                                             \
            for (int j = 0; j < OT; j++) acc[i][j] = _mm512_setzero_ps();                                        \
        for (int64_t k = 0; k < K; k += 32) {                                                                    \
            __m512i xv[RT];                                                                                      \
            for (int i = 0; i < RT; i++) xv[i] = _mm512_loadu_si512(x + i * K + k);                             \
            for (int j = 0; j < OT; j++) {                                                                       \
                if (prefetch >> j & 1) _mm_prefetch((const char *)(wr[j] + 16 * K + k), _MM_HINT_T1);            \
                const __m512i wv = _mm512_loadu_si512(wr[j] + k);                                                \
                for (int i = 0; i < RT; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv[i], (__m512bh)wv); \
            }                                                                                                    \
        }                                                                                                        \
        v16f r[16]; /* (in registers: the transpose-reduce needs no stores and loads) */                        \
        for (int i = 0; i < RT; i++)                                                                             \
            for (int j = 0; j < OT; j++) r[i * OT + j] = (v16f)acc[i][j];                                        \
        const v16f sums = sum16v(r);                                                                             \
        memcpy(out16, &sums, 64);                                                                                \
    }
TILE(4)
TILE(2)
TILE(1)

/* y[R][O] = x[R][K] . w[O][K]^T (+ bias[O], fp32), bf16 in and out, fp32 sums; K % 32 == 0. */
int kvchat_bf16_linear(const uint16_t *x, int64_t R, int64_t K, const uint16_t *w, int64_t O, const float *bias,
                        uint16_t *y, int nthreads)
{
    const int64_t rt = R >= 4 ? 4 : (R >= 2 ? 2 : 1), ot = 16 / rt, padded = (R + rt - 1) / rt * rt;
    uint16_t *xpad = 0;
    if (padded != R) { /* zero rows up to a whole tile */
        xpad = (uint16_t *)calloc((size_t)(padded * K), sizeof(uint16_t));
        if (!xpad) return -1;
        memcpy(xpad, x, sizeof(uint16_t) * (size_t)(R * K));
        x = xpad;
    }
    const int64_t nblocks = (O + 15) / 16, nrt = padded / rt;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        float out16[16];
        const int64_t o_end = (blk + 1) * 16 < O ? (blk + 1) * 16 : O;
        /* output tiles outer: their weight rows are read from memory once, as one steady stream, and reused
           by every row tile from L1 */
        for (int64_t o0 = blk * 16; o0 < o_end; o0 += ot)
            for (int64_t r0 = 0; r0 < padded; r0 += rt) {
                /* the weights 16 outputs on are fetched (into L2) as the tile's rows pass, spread over the first
                   row tiles, one output row each, rather than all by the first row tile in a burst. SmolLM2's linear
                   layers + LM head, weights from memory: 16 rows 17.2 -> 15.3 ms, 30 rows 31.6 -> 29.1, 1 row the
                   same (2-core AVX512-BF16 EPYC) */
                const int64_t ri = r0 / rt, spread = nrt < ot ? nrt : ot;
                unsigned mask = 0;
                for (int64_t j = ri; ri < spread && j < ot; j += spread) mask |= 1u << j;
                if (rt == 4) tile_4(x + r0 * K, K, w, O, o0, mask, out16);
                else if (rt == 2) tile_2(x + r0 * K, K, w, O, o0, mask, out16);
                else tile_1(x + r0 * K, K, w, O, o0, mask, out16);
                if (o0 + ot <= o_end) { /* a whole tile: bias, rounding and stores as vectors */
                    v16f v = load16(out16);
                    if (bias)
                        for (int64_t l = 0; l < 16; l++) v[l] += bias[o0 + l % ot];
                    uint16_t hv[16];
                    bf16_store16(hv, v);
                    for (int64_t i = 0; i < rt && r0 + i < R; i++)
                        memcpy(y + (r0 + i) * O + o0, hv + i * ot, sizeof(uint16_t) * (size_t)ot);
                } else {
                    for (int64_t i = 0; i < rt && r0 + i < R; i++)
                        for (int64_t j = 0; j < ot && o0 + j < o_end; j++)
                            y[(r0 + i) * O + o0 + j] = bf16_store(out16[i * ot + j] + (bias ? bias[o0 + j] : 0.0f));
                }
            }
    }
    free(xpad);
    return 0;
}
"""
)


@functools.cache
def available() -> bool:
    """Whether this CPU has AVX512-BF16 (the kernel is built with ``-march=native``)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where the CPU lacks AVX512-BF16, kernels are disabled or the build fails."""
    if not available():
        return None
    lib = open_library("bf16_linear", _SOURCE, "F.linear")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvchat_bf16_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.kvchat_bf16_linear.restype = ctypes.c_int
    return lib


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes this matmul: CPU bf16, 1..MAX_ROWS rows, input dim a multiple of 32."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and weight.shape[1] % 32 == 0
        and weight.is_contiguous()
        and (bias is None or bias.shape == (weight.shape[0],))
    )


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a ``fits`` case."""
    rows, out_features = x.shape[0], weight.shape[0]
    xc = x.contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty((rows, out_features), dtype=torch.bfloat16)
    status = lib.kvchat_bf16_linear(
        xc.data_ptr(),
        rows,
        x.shape[1],
        weight.data_ptr(),
        out_features,
        None if bf is None else bf.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("bf16 linear kernel: out of memory for its padded input")
    return y
