"""Opt-in weight-only int8 quantization for CPU decode (``EngineConfig.quantization = "int8"``), lossy.

``torch.ops.aten._weight_int8pack_mm`` reads int8 weights with per-output-channel scales, fewer bytes a decode step.
NOTE: it is only fast for a few rows, so wider batches multiply by the dequantized weights (the same effective
weights, another rounding): ``kernels.py`` holds the row limit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Int8Weight:
    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], activation dtype
    dense: torch.Tensor  # (q × scales) in the activation dtype, for wide batches

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape


def quantize(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 (scale = max |w| / 127)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales_act = scales.to(weight.dtype)
    dense = (q.float() * scales_act.float()[:, None]).to(weight.dtype)
    return Int8Weight(q.contiguous(), scales_act.contiguous(), dense.contiguous())


def linear(_: ctypes.CDLL | None, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q x scales)^T (+ bias)`` with aten's int8pack kernel (``kernels.py``'s ``int8pack_mm`` row: few rows;
    wider batches take F.linear on ``weight.dense``)."""
    out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.q, weight.scales)
    return out if bias is None else out + bias
