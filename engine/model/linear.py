"""``linear(x, weight)`` over every weight layout the model can hold.

The layout was chosen at load (``kernels.weight_layout``); per call, the first row of ``kernels.linear_plan`` for that
layout whose row limit and shape check take the input runs. Every implementation has the same interface: ``(lib, x,
weight, bias) -> y``, or None where it cannot take this input (the next row then runs).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model import amx_linear, bf16_linear, panel_linear, quant
from engine.model.bf16_linear import Bf16Panels
from engine.model.kernels import Layout, linear_plan
from engine.model.panel_linear import PanelWeight
from engine.model.quant import Int8Weight

Weight = torch.Tensor | PanelWeight | Bf16Panels | Int8Weight
Kernel = Callable[[ctypes.CDLL | None, torch.Tensor, Weight, torch.Tensor | None], torch.Tensor | None]


def _dense(_: ctypes.CDLL | None, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dense(w), bias)


def _wide(_: ctypes.CDLL | None, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """F.linear on the dense copy kept beside pair panels (None where the weight keeps none: the LM head)."""
    return F.linear(x, w.wide, bias) if isinstance(w, Bf16Panels) and w.wide is not None else None


def _amx(lib: ctypes.CDLL | None, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    ok = lib is not None and isinstance(w, Bf16Panels) and amx_linear.takes(x, w)
    return amx_linear.run(lib, x, w, bias) if ok else None  # type: ignore[arg-type]


def _checked(kernel: Callable[..., torch.Tensor | None], kind: type) -> Kernel:
    """``kernel`` for weights of type ``kind`` (None for any other)."""

    def run(lib: ctypes.CDLL | None, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
        return kernel(lib, x, w, bias) if lib is not None and isinstance(w, kind) else None

    return run


KERNELS: dict[str, Kernel] = {
    "F.linear_dense_copy": _wide,
    "amx_tiles": _amx,
    "bf16_pairs": _checked(bf16_linear.linear, Bf16Panels),
    "fp32_panels": _checked(panel_linear.linear, PanelWeight),
    "int8pack_mm": lambda lib, x, w, bias: quant.linear(lib, x, w, bias) if isinstance(w, Int8Weight) else None,
    "F.linear": _dense,
}


LAYOUTS: dict[type, Layout] = {Bf16Panels: Layout.BF16_PANELS, PanelWeight: Layout.FP32_PANELS}
LAYOUTS |= {Int8Weight: Layout.INT8}
LAYOUTS |= {torch.Tensor: Layout.DENSE, torch.nn.Parameter: Layout.DENSE}


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    for impl, lib in linear_plan(LAYOUTS.get(type(weight), Layout.DENSE), x.dtype):
        if impl.takes_rows(rows) and (y := KERNELS[impl.name](lib, x, weight, bias)) is not None:
            return y
    return F.linear(x, dense(weight), bias)  # NOTE: not reached for weights the loader made (a layout has a kernel)


def dense(weight: Weight) -> torch.Tensor:
    """The weight as one dense tensor in the activation dtype."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense
