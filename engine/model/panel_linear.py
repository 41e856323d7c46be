"""fp32 matmuls over weights in 16-output panels: ``y = x W^T (+ bias)`` for any number of rows (AVX2/FMA or AVX-512).

Layout: ``panels[p, k, j] = W[16 p + j, k]`` (zeros past the last output); the kernel is the outer-product register
tile (as in BLIS), and batches of ``BLOCKED_MIN_ROWS`` rows or more take a blocked form (k slices x row blocks) so
a prefill chunk's ``x`` stays in cache. The panels replace the dense weights (no extra memory).

NOTE: every output sums in one order whatever the tile, the form or the batch (fused multiply-add chains over slices
of 64 inputs, added slice by slice), so a row gives the same bits alone and in any batch, on AVX2 and AVX-512 builds.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from engine.model.build import open_library

PANEL = 16  # outputs per panel (two 8-lane vectors)
BLOCKED_MIN_ROWS = 32  # batches of this many rows or more take the blocked form (k slices x row blocks)


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
def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where kernels are disabled or the build fails (``kernels.library("panel_linear")``
    asks only on a CPU the table's rows are for: x86 with AVX2 and FMA)."""
    lib = open_library("panel_linear", "F.linear on the dense weights")
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
