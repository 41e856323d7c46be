"""Linear layers straight from a GGUF's quantized blocks (``q4_0``, ``q4_1``, ``q8_0``) for few-row batches.

A decode step is bound by reading weights; the blocks are 0.6-1.1 bytes a weight instead of 2 or 4. NOTE: lossless by
construction: ``pack`` keeps the blocks only where dequantizing them gives the dense weights bit for bit, and the
kernel computes in fp32 from those exact weights. A ``PackedWeight`` keeps the dense copy for wider batches
(``kernels.py`` holds the row limits).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.build import open_library

log = logging.getLogger(__name__)

BLOCK = 32  # weights per block, every format
FORMATS: dict[str, tuple[int, int]] = {"q4_0": (0, 18), "q4_1": (1, 20), "q8_0": (2, 34)}  # (kernel id, bytes)


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
    lib = open_library("packed_linear", "dense weights")
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


def linear(
    lib: ctypes.CDLL, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``F.linear(x, weight.dense, bias)`` from the blocks; None where the shapes do not fit (the dense path then
    raises the usual error)."""
    out_features, in_features = weight.dense.shape
    fits = x.dim() == 2 and x.shape[1] == in_features and (bias is None or bias.shape == (out_features,))
    return blocks_linear(lib, x, weight.blocks, weight.fmt, out_features, bias) if fits and x.shape[0] > 0 else None


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
