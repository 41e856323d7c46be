"""bf16 matmuls with AVX512-BF16 (``vdpbf16ps``) over weights held in 16-output pair panels: ``y = x W^T (+ bias)``
for any number of rows.

Layout: ``panels[p, k // 2, j, k % 2] = W[16 p + j, k]`` (zeros past the last output): one 64-byte line holds a pair
of input dims for 16 outputs, what one ``vdpbf16ps`` multiplies by a broadcast pair of ``x`` values, so the kernel is
an outer-product register tile with no horizontal sums. The panels replace the dense weights (no extra memory).

NOTE: every output is one ``vdpbf16ps`` chain over the input pairs from zero, then ``+ bias`` and one rounding,
whatever the tile or the batch: a row gives the same bits alone and in any batch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.build import open_library

PANEL = 16  # outputs per panel


@dataclass(frozen=True, slots=True)
class Bf16Panels:
    """A bf16 linear weight ``[out, in]`` held as pair panels ``[ceil(out / 16), in / 2, 16, 2]`` (zeros past
    ``out``); ``wide``: the same weight dense, kept where the table sends calls of many rows to ``F.linear``
    (``kernels.dense_copy_rows``), else None."""

    panels: torch.Tensor
    out_features: int
    wide: torch.Tensor | None = None

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


def to_panels(weight: torch.Tensor, keep_dense: bool = False) -> Bf16Panels:
    """``weight`` (``[out, in]``, bf16, ``in`` even) as pair panels (``keep_dense``: holding ``weight`` too, as
    ``wide``)."""
    if not convertible(weight):
        raise ValueError(
            f"pair panels need a 2-D bf16 CPU weight of even width, got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    n = -(-out_features // PANEL)
    padded = torch.zeros(n * PANEL, in_features, dtype=torch.bfloat16)
    padded[:out_features] = weight
    panels = padded.view(n, PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Bf16Panels(panels, out_features, weight.contiguous() if keep_dense else None)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where kernels are disabled or the build fails (``kernels.library("bf16_panels")``
    asks only on a CPU with AVX512-BF16: the table's rows say so)."""
    lib = open_library("bf16_panels", "F.linear")
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
