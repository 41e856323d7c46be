"""bf16 matmuls with AVX512-BF16 (``vdpbf16ps``) over weights held in 16-output pair panels: ``y = x W^T (+ bias)``
for any number of rows.

Why: oneDNN's bf16 GEMM (what ``F.linear`` runs) is built for many rows and leaves most of the multiply-add rate
unused for the 1-30 rows of a decode step; an earlier kernel here took the row-major weights as they are, one dot
product per row/output pair, and spent ~14% of its instructions on the horizontal sums that layout needs. Measured on
a 2-core AMD EPYC (Zen 4, AVX512-BF16, ~215 GMAC/s peak), SmolLM2's 121 linear layers + LM head per step, weights
from memory (huge pages), best of 5, interleaved (``python`` wrapper included for the panels only):

    rows                1     16     30     96    128    512   2048
    pair panels       8.9   11.1   23.8   59.8   80.5    327   1385 ms
    row-major kernel  9.1   13.1   26.1   70.6      -      -      - ms
    F.linear (oneDNN) 18    27.1   36.4   78.8   98.0    354   1499 ms

so every batch, prefill chunks too, takes the panels, which replace the dense weights (no extra memory, except that a
tied LM head becomes a panel copy of the embedding table, which stays dense for the lookup).

Layout: ``panels[p, k // 2, j, k % 2] = W[16 p + j, k]`` (zeros past the last output): one 64-byte line holds a pair
of input dims for 16 outputs, which is what one ``vdpbf16ps`` multiplies by a broadcast pair of ``x`` values. Kernel:
the outer-product register tile (as ``panel_linear.py`` in fp32): tiles of 16 rows x one panel (16 accumulators),
then 8, 4, 2 and 1 rows; threads split the panels, each panel serves every row tile from cache while the tiles
prefetch the thread's next panel into L2, a share of its lines each. No horizontal sums, no conversions.

Exactness: every output is one ``vdpbf16ps`` chain over the input pairs from zero, then ``+ bias`` (fp32) and one
rounding to bf16, whatever the tile or the batch: a row gives the same bits alone and in any batch (test). Results
differ from ``F.linear`` by summation order, and for subnormal values, which ``vdpbf16ps`` takes and gives as zero.
Threads split the panels, not the rows: with many threads a layer of few panels (SmolLM2's narrowest: 36) loads them
unevenly (not measured beyond 2 threads). Built and used only where the CPU has AVX512-BF16; elsewhere the dense
weights stay.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device import cpu_flags
from engine.model.cpu_kernels import C_PRELUDE, open_library

PANEL = 16  # outputs per panel

# Output rows of a panel from fp32 accumulators (also amx_linear.py's, over its stored accumulator tiles)
PUT_SOURCE = r"""
/* rows r0 .. r0 + rt of y for panel p: + bias (fp32), rounded to bf16 (nearest even), outputs past O left out */
static inline void put(const __m512 *acc, const int rt, const int64_t r0, const int64_t p, const int64_t O,
                       const float *bias, uint16_t *y) {
    const int64_t o0 = p * 16, n = O - o0 < 16 ? O - o0 : 16;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + o0) : _mm512_setzero_ps();
    for (int r = 0; r < rt; r++) {
        const __m256bh h = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[r], b) : acc[r]);
        _mm256_mask_storeu_epi16(y + (r0 + r) * O + o0, mask, (__m256i)h);
    }
}
"""

_SOURCE = (
    C_PRELUDE
    + r"""
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

"""
    + PUT_SOURCE
    + r"""

/* y[R][O] = x[R][K] . W^T (+ bias) with W as pair panels [ceil(O / 16)][K / 2][16][2]; K even. Threads split the
   panels (contiguous runs, so each knows its next one to prefetch), row tiles share each panel's lines. */
void kvchat_bf16_panels(const uint16_t *x, int64_t R, int64_t K, const uint16_t *panels, int64_t O,
                        const float *bias, uint16_t *y, int nthreads)
{
    const int64_t npanels = (O + 15) / 16, pairs = K / 2;
    const uint32_t *x32 = (const uint32_t *)x;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t lo = npanels * tid / nth, hi = npanels * (tid + 1) / nth;
        for (int64_t p = lo; p < hi; p++) {
            __m512 acc[16];
            const uint16_t *pan = panels + p * pairs * 32, *pf = p + 1 < hi ? pan + pairs * 32 : pan;
            const int64_t lines = p + 1 < hi ? pairs : 0;
            int64_t r = 0, done = 0; /* rows done; next-panel lines prefetched so far (lines * r / R) */
#define TILE_AT(RT)                                                                                           \
    do {                                                                                                      \
        const int64_t from = done;                                                                            \
        done = lines * (r + RT) / R;                                                                          \
        tile_##RT(x32 + r * pairs, pairs, pan, pf, from, done, acc);                                          \
        put(acc, RT, r, p, O, bias, y);                                                                       \
        r += RT;                                                                                              \
    } while (0)
            while (r + 16 <= R) TILE_AT(16);
            if (r + 8 <= R) TILE_AT(8);
            if (r + 4 <= R) TILE_AT(4);
            if (r + 2 <= R) TILE_AT(2);
            if (r < R) TILE_AT(1);
#undef TILE_AT
        }
    }
}
"""
)


@dataclass(frozen=True, slots=True)
class Bf16Panels:
    """A bf16 linear weight ``[out, in]`` held as pair panels ``[ceil(out / 16), in / 2, 16, 2]`` (zeros past
    ``out``)."""

    panels: torch.Tensor
    out_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, 2 * self.panels.shape[1]))

    @property
    def dense(self) -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor (a new copy)."""
        n, pairs = self.panels.shape[0], self.panels.shape[1]
        return self.panels.permute(0, 2, 1, 3).reshape(n * PANEL, 2 * pairs)[: self.out_features].contiguous()


def convertible(weight: torch.Tensor) -> bool:
    """Whether ``to_panels`` takes this weight: 2-D bf16 on CPU with an even input width."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % 2 == 0
        and weight.shape[0] > 0
    )


def to_panels(weight: torch.Tensor) -> Bf16Panels:
    """``weight`` (``[out, in]``, bf16, ``in`` even) as pair panels."""
    if not convertible(weight):
        raise ValueError(
            f"pair panels need a 2-D bf16 CPU weight of even width, got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    n = -(-out_features // PANEL)
    padded = torch.zeros(n * PANEL, in_features, dtype=torch.bfloat16)
    padded[:out_features] = weight
    panels = padded.view(n, PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Bf16Panels(panels, out_features)


@functools.cache
def available() -> bool:
    """Whether this CPU has AVX512-BF16 (the kernel is built with ``-march=native``)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where the CPU lacks AVX512-BF16, kernels are disabled or the build fails."""
    if not available():
        return None
    lib = open_library("bf16_panels", _SOURCE, "F.linear")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvchat_bf16_panels.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.kvchat_bf16_panels.restype = None
    return lib


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: Bf16Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dense, bias)`` for bf16 CPU ``x`` ``[rows, in]``."""
    _, in_features = x.shape
    if x.dtype != torch.bfloat16 or in_features != 2 * weight.panels.shape[1]:  # (not .shape: a new Size per call)
        raise ValueError(
            f"pair panel weight {tuple(weight.shape)} cannot take {x.dtype} input of shape {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"pair panel weight {tuple(weight.shape)} cannot take a bias of shape {tuple(bias.shape)}")
    return call(lib.kvchat_bf16_panels, x, weight, bias)[0]


def call(
    fn: Callable[..., int | None], x: torch.Tensor, weight: Bf16Panels, bias: torch.Tensor | None
) -> tuple[torch.Tensor, int | None]:
    """``x W^T (+ bias)`` into a new bf16 tensor by a pair-panel kernel ``fn`` that takes ``kvchat_bf16_panels``'s
    arguments (``amx_linear``'s kernel takes the same), with what ``fn`` returned (None for no rows); the caller
    checked the shapes."""
    rows, in_features = x.shape
    y = torch.empty((rows, weight.out_features), dtype=torch.bfloat16)
    if rows == 0:
        return y, None
    xc = x.contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    status = fn(
        xc.data_ptr(),
        rows,
        in_features,
        weight.panels.data_ptr(),
        weight.out_features,
        None if bf is None else bf.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y, status
