"""``linear(x, weight)`` over every weight representation the model can hold.

* a dense tensor (``F.linear``);
* ``PackedWeight``: the GGUF's quantized blocks, lossless (``packed.py``; on by default for GGUF-converted models);
* ``Int8Weight``: opt-in weight-only int8, lossy (``quant.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import packed, quant
from engine.model.packed import PackedWeight
from engine.model.quant import Int8Weight

Weight = torch.Tensor | PackedWeight | Int8Weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, PackedWeight):
        return packed.linear(x, weight, bias)
    if isinstance(weight, Int8Weight):
        return quant.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def dense(weight: Weight) -> torch.Tensor:
    """The weight as one dense tensor in the activation dtype."""
    return weight if isinstance(weight, torch.Tensor) else weight.dense
