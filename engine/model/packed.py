"""Packed GGUF weights: few-row matmuls that read a model's quantized blocks instead of its dense fp32/bf16 copy.

Why: a decode step is bound by reading weights. A model converted from a GGUF (the default SmolLM2 is Q4_1 with a
Q8_0 embedding) holds dense weights that are *exactly* ``dequantize(blocks)``; reading the blocks instead (0.6-1.1
bytes per weight instead of 4) and dequantizing in registers gives the same weights for a fraction of the memory
traffic. Measured on a 2-core AVX2 CPU, SmolLM2's 210 linear layers, fp32: 12.8 ms per step at one row vs 32 ms with
the dense matmul; about even at ~64 rows, where dense matmuls (compute-bound) take over (``PACKED_MAX_ROWS``).

Lossless, and checked: ``pack`` dequantizes the blocks with the kernel and keeps them only when the result equals the
dense weights bit for bit (after rounding to bf16 when the model runs in bf16, as the dense copy was). The kernel
computes ``x @ W^T`` in fp32 from those exact weights, so outputs differ from the dense matmul only by summation order,
as two batch shapes do. ``d * q`` is exact in fp32 for every format here, so a fused multiply-add dequantizes to the
same value as gguf's multiply-then-add.

Formats (ggml block layouts, 32 weights per block): ``q4_0`` (f16 d, 16 bytes of nibbles; w = (q - 8) d), ``q4_1``
(f16 d, f16 m, nibbles; w = q d + m), ``q8_0`` (f16 d, 32 int8; w = q d). Low nibbles are weights 0-15, high 16-31.
The kernel is C (AVX2/FMA intrinsics where available, plain C otherwise) built like ``cpu_kernels``; without a compiler
(or with ``KVCHAT_DISABLE_KERNELS=1``) nothing is packed and the dense weights are used.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import open_library

log = logging.getLogger(__name__)

# NOTE: measured crossover (SmolLM2 layers, fp32, AVX2, 2 threads): packed 60 vs dense 95 ms at 30 rows, about even
# at 64, dense ahead at 128 (281 vs 238 ms). In bf16 an AMX CPU multiplies 16 rows of dense bf16 weights in about the
# time of one (21 vs 22 ms for SmolLM2's layers, measured on such a machine) while this kernel computes in fp32
# (~15 ms at 4 rows, ~35 at 16 here), so bf16 batches wider than PACKED_MAX_ROWS_BF16 take the dense weights.
PACKED_MAX_ROWS = 48
PACKED_MAX_ROWS_BF16 = 4
BLOCK = 32  # weights per block, every format
FORMATS: dict[str, tuple[int, int]] = {"q4_0": (0, 18), "q4_1": (1, 20), "q8_0": (2, 34)}  # (kernel id, bytes)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };

static inline int block_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

static inline float f16(const uint8_t *p) { _Float16 h; memcpy(&h, p, 2); return (float)h; }

static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* 32 weights of one block as fp32: exactly gguf's dequantization (d * q is exact in fp32, so a fused
   multiply-add rounds the same as gguf's multiply-then-add). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 u8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
static inline __m256 i8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
static inline __m256 rbf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __attribute__((always_inline)) void deq_regs(int fmt, const uint8_t *b, int bf16, __m256 *v) {
    const __m256 d = _mm256_set1_ps(f16(b));
    if (fmt == FMT_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        v[0] = _mm256_mul_ps(i8x8(q0), d);
        v[1] = _mm256_mul_ps(i8x8(_mm_srli_si128(q0, 8)), d);
        v[2] = _mm256_mul_ps(i8x8(q1), d);
        v[3] = _mm256_mul_ps(i8x8(_mm_srli_si128(q1, 8)), d);
    } else {
        const int off = fmt == FMT_Q4_1 ? 4 : 2;
        const __m256 m = fmt == FMT_Q4_1 ? _mm256_set1_ps(f16(b + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + off)), mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        if (fmt == FMT_Q4_1) {
            v[0] = _mm256_fmadd_ps(u8x8(lo), d, m);
            v[1] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(lo, 8)), d, m);
            v[2] = _mm256_fmadd_ps(u8x8(hi), d, m);
            v[3] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(hi, 8)), d, m);
        } else { /* (q - 8) * d, with q - 8 exact */
            const __m256 eight = _mm256_set1_ps(8.0f);
            v[0] = _mm256_mul_ps(_mm256_sub_ps(u8x8(lo), eight), d);
            v[1] = _mm256_mul_ps(_mm256_sub_ps(u8x8(_mm_srli_si128(lo, 8)), eight), d);
            v[2] = _mm256_mul_ps(_mm256_sub_ps(u8x8(hi), eight), d);
            v[3] = _mm256_mul_ps(_mm256_sub_ps(u8x8(_mm_srli_si128(hi, 8)), eight), d);
            (void)m;
        }
    }
    if (bf16) for (int i = 0; i < 4; i++) v[i] = rbf16(v[i]);
}
static inline __attribute__((always_inline)) void deq_block(int fmt, const uint8_t *b, int bf16, float *w) {
    __m256 v[4];
    deq_regs(fmt, b, bf16, v);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, v[i]);
}
#define HAVE_FUSED 1
/* RB rows x OB output rows, dequantizing each block straight into registers (no tile buffer): for few rows the
   tile's store and reload cost more than the multiply-adds. */
#define FUSED(RB, OB)                                                                                         \
static inline __attribute__((always_inline)) void fused_##RB##_##OB(                                         \
    int fmt, int bf16, const float *x, int64_t K, const uint8_t *w, int64_t row_bytes, int bb, float *out) {  \
    __m256 acc[RB][OB][4];                                                                                    \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) for (int j = 0; j < 4; j++)                    \
        acc[r][o][j] = _mm256_setzero_ps();                                                                   \
    for (int64_t b = 0; b < K / 32; b++) {                                                                    \
        for (int o = 0; o < OB; o++) {                                                                        \
            __m256 v[4];                                                                                      \
            deq_regs(fmt, w + o * row_bytes + b * bb, bf16, v);                                               \
            for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++)                                          \
                acc[r][o][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + b * 32 + 8 * j), v[j], acc[r][o][j]); \
        }                                                                                                     \
    }                                                                                                         \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) {                                               \
        const __m256 a01 = _mm256_add_ps(acc[r][o][0], acc[r][o][1]);                                        \
        out[r * OB + o] = hsum8((v8f)_mm256_add_ps(a01, _mm256_add_ps(acc[r][o][2], acc[r][o][3])));          \
    }                                                                                                         \
}

#else
static inline float rbf16s(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static inline void deq_block(int fmt, const uint8_t *b, int bf16, float *w) {
    const float d = f16(b);
    for (int j = 0; j < 32; j++) {
        float v;
        if (fmt == FMT_Q8_0) v = (float)(int8_t)b[2 + j] * d;
        else {
            const int off = fmt == FMT_Q4_1 ? 4 : 2;
            const int q = j < 16 ? (b[off + j] & 15) : (b[off + j - 16] >> 4);
            v = fmt == FMT_Q4_1 ? (float)q * d + f16(b + 2) : (float)(q - 8) * d;
        }
        w[j] = bf16 ? rbf16s(v) : v;
    }
}
#endif

/* y[r][o] for RB rows x OB outputs, over K (multiple of 8); weights dequantized into w (OB rows of K) */
#define MICRO(RB, OB)                                                                                         \
static inline __attribute__((always_inline)) void micro_##RB##_##OB(                                         \
    const float *x, int64_t xs, const float *w, int64_t K, float *out /* [RB][OB] */) {                     \
    v8f acc[RB][OB];                                                                                          \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) acc[r][o] = (v8f){0};                          \
    for (int64_t k = 0; k < K; k += 8) {                                                                      \
        v8f wv[OB];                                                                                           \
        for (int o = 0; o < OB; o++) wv[o] = ld8(w + o * K + k);                                              \
        for (int r = 0; r < RB; r++) {                                                                        \
            const v8f xv = ld8(x + r * xs + k);                                                               \
            for (int o = 0; o < OB; o++) acc[r][o] += xv * wv[o];                                             \
        }                                                                                                     \
    }                                                                                                         \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) out[r * OB + o] = hsum8(acc[r][o]);            \
}
MICRO(6, 2) /* 12 accumulators: measured best of 4x2, 4x3, 3x4, 5x2, 6x2, 7x2 on AVX2 */
MICRO(2, 4)
MICRO(1, 8)
#ifdef HAVE_FUSED
FUSED(1, 2)
FUSED(1, 1)
FUSED(2, 1)
#endif

#define OT 8

/* y[r][o] = v + bias[o], rounded to bf16 when the activations are bf16 */
static inline void put(void *y, int y_bf16, int64_t r, int64_t O, int64_t o, float v, const float *bias) {
    const int64_t idx = r * O + o;
    if (bias) v += bias[o];
    if (y_bf16) {
        uint32_t u; memcpy(&u, &v, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { ((uint16_t *)y)[idx] = (uint16_t)((u >> 16) | 0x40u); return; } /* NaN */
        u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)y)[idx] = (uint16_t)(u >> 16);
    } else {
        ((float *)y)[idx] = v;
    }
}

/* y[R, O] = x[R, K] @ W^T (+ bias); W packed rows of K/32 blocks. x fp32 (already converted). */
void kvchat_packed_linear(const float *x, int64_t R, int64_t K, const uint8_t *w, int fmt, int64_t O,
                          const float *bias, void *y, int bf16, int nthreads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
    const int64_t ntiles = (O + OT - 1) / OT;
#ifdef HAVE_FUSED
    if (R <= 2) {
        const int bb = block_bytes(fmt);
        const int64_t step = R == 1 ? 2 : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t o = 0; o < O; o += step) {
            float res[2];
            const uint8_t *wo = w + o * row_bytes;
            int n = 1;
            if (R == 1 && o + 1 < O) { fused_1_2(fmt, bf16, x, K, wo, row_bytes, bb, res); n = 2; }
            else if (R == 1) fused_1_1(fmt, bf16, x, K, wo, row_bytes, bb, res);
            else fused_2_1(fmt, bf16, x, K, wo, row_bytes, bb, res);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < n; j++) put(y, bf16, r, O, o + j, res[r * n + j], bias);
        }
        return;
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
        float *wt = (float *)aligned_alloc(64, sizeof(float) * (size_t)(OT * K));
        float res[12];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            if (!wt) continue; /* out of memory: leave y unset rather than crash (cannot happen at these sizes) */
            const int64_t o0 = t * OT, on = (O - o0 < OT) ? O - o0 : OT;
            for (int64_t o = 0; o < on; o++) {
                const uint8_t *row = w + (o0 + o) * row_bytes;
                for (int64_t b = 0; b < nb; b++) deq_block(fmt, row + b * block_bytes(fmt), bf16, wt + o * K + b * 32);
            }
            for (int64_t o = on; o < OT; o++) memset(wt + o * K, 0, sizeof(float) * K);
            int64_t r = 0;
            for (; r + 6 <= R; r += 6)
                for (int o = 0; o < OT; o += 2) {
                    micro_6_2(x + r * K, K, wt + o * K, K, res);
                    for (int i = 0; i < 6; i++)
                        for (int j = 0; j < 2; j++)
                            if (o + j < on) put(y, bf16, r + i, O, o0 + o + j, res[i * 2 + j], bias);
                }
            for (; r + 2 <= R; r += 2)
                for (int o = 0; o < OT; o += 4) {
                    micro_2_4(x + r * K, K, wt + o * K, K, res);
                    for (int i = 0; i < 2; i++) for (int j = 0; j < 4; j++)
                        if (o + j < on) put(y, bf16, r + i, O, o0 + o + j, res[i * 4 + j], bias);
                }
            for (; r < R; r++) {
                micro_1_8(x + r * K, K, wt, K, res);
                for (int j = 0; j < on; j++) put(y, bf16, r, O, o0 + j, res[j], bias);
            }
        }
        free(wt);
    }
}

void kvchat_packed_dequant(const uint8_t *w, int fmt, int64_t O, int64_t K, float *out, int bf16, int nthreads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < O; o++)
        for (int64_t b = 0; b < nb; b++)
            deq_block(fmt, w + o * row_bytes + b * block_bytes(fmt), bf16, out + o * K + b * 32);
}
"""


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight ``[out, in]`` held twice: as GGUF blocks (few-row matmuls) and dense (wide batches)."""

    blocks: torch.Tensor  # uint8 [out, in // 32 * bytes per block]
    fmt: str  # a key of FORMATS
    dense: torch.Tensor  # the same weights in the activation dtype

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built or kernels are disabled."""
    lib = open_library("packed_linear", _SOURCE, "dense weights")
    if lib is None:
        return None
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvchat_packed_linear.argtypes = [ptr, i64, i64, ptr, cint, i64, ptr, ptr, cint, cint]
    lib.kvchat_packed_linear.restype = None
    lib.kvchat_packed_dequant.argtypes = [ptr, cint, i64, i64, ptr, cint, cint]
    lib.kvchat_packed_dequant.restype = None
    return lib


def row_bytes(fmt: str, in_features: int) -> int:
    return in_features // BLOCK * FORMATS[fmt][1]


def dequantize(lib: ctypes.CDLL, blocks: torch.Tensor, fmt: str, in_features: int, bf16: bool) -> torch.Tensor:
    """The fp32 weights ``[out, in]`` the kernel computes with (rounded to bf16 precision when ``bf16``)."""
    out = torch.empty((blocks.shape[0], in_features), dtype=torch.float32)
    lib.kvchat_packed_dequant(
        blocks.data_ptr(), FORMATS[fmt][0], blocks.shape[0], in_features, out.data_ptr(), int(bf16), _threads()
    )
    return out


def pack(parts: Sequence[tuple[torch.Tensor, str]], dense: torch.Tensor) -> PackedWeight | None:
    """Stack the block rows of ``parts`` (e.g. q, k, v) into one weight, if they are exactly ``dense``.

    None when the kernel is unavailable, the formats differ, the shapes do not fit, or the dequantized blocks are
    not bit-identical to ``dense`` (logged: the dense weights are then used, nothing is lost but speed).
    """
    lib = load()
    if lib is None or dense.device.type != "cpu" or dense.dtype not in (torch.float32, torch.bfloat16):
        return None
    fmts = {fmt for _, fmt in parts}
    out_features, in_features = dense.shape
    if len(fmts) != 1 or in_features % BLOCK != 0:
        return None
    fmt = fmts.pop()
    if fmt not in FORMATS:
        return None
    blocks = torch.cat([b for b, _ in parts]).contiguous()
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (out_features, row_bytes(fmt, in_features)):
        log.warning(
            "packed blocks of shape %s do not fit a %s weight; using dense", tuple(blocks.shape), tuple(dense.shape)
        )
        return None
    bf16 = dense.dtype == torch.bfloat16
    if not torch.equal(dequantize(lib, blocks, fmt, in_features, bf16), dense.float()):
        log.warning("packed %s blocks differ from the dense %s weight; using dense", fmt, tuple(dense.shape))
        return None
    return PackedWeight(blocks, fmt, dense)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dense, bias)``: from the blocks for up to ``PACKED_MAX_ROWS`` rows (fp32;
    ``PACKED_MAX_ROWS_BF16`` in bf16), else from the dense weights."""
    lib = load()
    rows = x.shape[0]
    out_features, in_features = weight.dense.shape
    fits = x.dim() == 2 and x.shape[1] == in_features and (bias is None or bias.shape == (out_features,))
    limit = PACKED_MAX_ROWS_BF16 if x.dtype == torch.bfloat16 else PACKED_MAX_ROWS
    if lib is None or not fits or rows > limit or rows == 0:
        return F.linear(x, weight.dense, bias)  # (which raises the usual error for a shape that does not fit)
    return blocks_linear(lib, x, weight.blocks, weight.fmt, out_features, bias)


def blocks_linear(
    lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, fmt: str, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` straight from the GGUF ``blocks`` of ``W`` (``[rows, in]`` fp32 or bf16 ``x``, at least
    one row: with none the kernel would take its two-row path and read past ``x``)."""
    rows, in_features = x.shape
    if rows == 0:
        raise ValueError("blocks_linear needs at least one row")
    xf = x.to(torch.float32).contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty((rows, out_features), dtype=x.dtype)
    lib.kvchat_packed_linear(
        xf.data_ptr(),
        rows,
        in_features,
        blocks.data_ptr(),
        FORMATS[fmt][0],
        out_features,
        None if bf is None else bf.data_ptr(),
        y.data_ptr(),
        int(x.dtype == torch.bfloat16),
        _threads(),
    )
    return y


def _threads() -> int:
    return torch.get_num_threads()
