"""``linear(x, weight)`` over every weight representation the model can hold.

* a dense tensor (``F.linear``; in bf16 with up to ``bf16_linear.MAX_ROWS`` rows on an AVX512-BF16 CPU, our few-row
  kernel, ``bf16_linear.py``);
* ``PackedWeight``: the GGUF's quantized blocks, lossless (``packed.py``; on by default for GGUF-converted models;
  in bf16 only where the few-row kernel is not available, and for up to ``PACKED_MAX_ROWS_BF16`` rows);
* ``PanelWeight``: fp32 weights in 16-output panels for our outer-product kernel (``panel_linear.py``; on AVX2 CPUs
  without AVX-512, in fp32, in place of both of the above);
* ``Int8Weight``: opt-in weight-only int8, lossy (``quant.py``);
* ``OneDnnWeight``: any bf16 weight above plus oneDNN's reordered copy for AMX (``onednn_linear.py``; batches of
  ``MIN_ROWS..MAX_ROWS`` rows on a CPU with AMX; other batches take the weight it wraps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import bf16_linear, onednn_linear, packed, panel_linear, quant
from engine.model.onednn_linear import OneDnnWeight
from engine.model.packed import PackedWeight
from engine.model.panel_linear import PanelWeight
from engine.model.quant import Int8Weight

Weight = torch.Tensor | PackedWeight | PanelWeight | Int8Weight | OneDnnWeight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, OneDnnWeight):
        if onednn_linear.takes(x, bias):
            return onednn_linear.linear(x, weight, bias)
        return linear(x, weight.base, bias)
    if isinstance(weight, PanelWeight):
        if weight.blocks is not None and weight.fmt is not None and 0 < x.shape[0] <= panel_linear.BLOCKS_MAX_ROWS:
            blocks_lib = packed.load()
            if blocks_lib is not None:
                return packed.blocks_linear(blocks_lib, x, weight.blocks, weight.fmt, weight.out_features, bias)
        lib = panel_linear.load()
        if lib is None:  # NOTE: not reached: weights are only made panels where the kernel loaded
            raise RuntimeError("panel weights without the panel kernel")
        return panel_linear.linear(lib, x, weight, bias)
    if isinstance(weight, Int8Weight):
        return quant.linear(x, weight, bias)
    lib = bf16_linear.load() if x.dtype == torch.bfloat16 else None
    if isinstance(weight, PackedWeight):
        # NOTE: in bf16 the few-row kernel over the dense weights beats the packed blocks even for one row (reading
        # 2 bytes a weight at ~36 GB/s instead of decoding ~0.6: SmolLM2 step, 2 threads, 7.4 vs 13.4 ms)
        if lib is not None and bf16_linear.fits(x, weight.dense, bias):
            return bf16_linear.linear(lib, x, weight.dense, bias)
        return packed.linear(x, weight, bias)
    if lib is not None and bf16_linear.fits(x, weight, bias):
        return bf16_linear.linear(lib, x, weight, bias)
    return F.linear(x, weight, bias)


def dense(weight: Weight) -> torch.Tensor:
    """The weight as one dense tensor in the activation dtype."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense
