"""``linear(x, weight)`` over every weight representation the model can hold.

* a dense tensor (``F.linear``);
* ``Bf16Panels``: bf16 weights in 16-output pair panels for our AVX512-BF16 kernel (``bf16_linear.py``; on such
  CPUs, in bf16, in place of the dense weights, any number of rows), or, on a CPU with AMX, for our tile kernel
  (``amx_linear.py``; up to ``amx_linear.MAX_ROWS`` rows, for every weight whose input width it takes);
* ``PackedWeight``: the GGUF's quantized blocks, lossless (``packed.py``; on by default for GGUF-converted models;
  in bf16 only where the pair panels are not used, and for up to ``PACKED_MAX_ROWS_BF16`` rows);
* ``PanelWeight``: fp32 weights in 16-output panels for our outer-product kernel (``panel_linear.py``; on CPUs with
  AVX2 and FMA, in fp32, in place of both of the above, for every batch size);
* ``Int8Weight``: opt-in weight-only int8, lossy (``quant.py``);
* ``OneDnnWeight``: any bf16 weight above plus oneDNN's reordered copy for AMX (``onednn_linear.py``; batches of
  ``MIN_ROWS..MAX_ROWS`` rows on a CPU with AMX, except those the tile kernel takes from pair panels; other batches
  take the weight it wraps).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.model import amx_linear, bf16_linear, onednn_linear, packed, panel_linear, quant
from engine.model.bf16_linear import Bf16Panels
from engine.model.onednn_linear import OneDnnWeight
from engine.model.packed import PackedWeight
from engine.model.panel_linear import PanelWeight
from engine.model.quant import Int8Weight

Weight = torch.Tensor | PackedWeight | PanelWeight | Bf16Panels | Int8Weight | OneDnnWeight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, OneDnnWeight):
        if isinstance(weight.base, Bf16Panels) and (tiles := _tiles(x, weight.base)) is not None:
            return amx_linear.run(tiles, x, weight.base, bias)
        if onednn_linear.takes(x, bias, weight):
            return onednn_linear.linear(x, weight, bias)
        return linear(x, weight.base, bias)
    if isinstance(weight, PanelWeight):
        lib = panel_linear.load()
        if lib is None:  # NOTE: not reached: weights are only made panels where the kernel loaded
            raise RuntimeError("panel weights without the panel kernel")
        return panel_linear.linear(lib, x, weight, bias)
    if isinstance(weight, Bf16Panels):
        tiles = _tiles(x, weight)
        if tiles is not None:
            return amx_linear.run(tiles, x, weight, bias)
        lib = bf16_linear.load()
        if lib is None:  # NOTE: not reached: weights are only made panels where the kernel loaded
            raise RuntimeError("bf16 pair panels without the bf16 kernel")
        return bf16_linear.linear(lib, x, weight, bias)
    if isinstance(weight, Int8Weight):
        return quant.linear(x, weight, bias)
    if isinstance(weight, PackedWeight):
        return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _tiles(x: torch.Tensor, weight: Bf16Panels) -> ctypes.CDLL | None:
    """The AMX kernel where it takes ``x`` for ``weight``, else None."""
    lib = amx_linear.load()
    return lib if lib is not None and amx_linear.takes(x, weight) else None


def dense(weight: Weight) -> torch.Tensor:
    """The weight as one dense tensor in the activation dtype."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense
