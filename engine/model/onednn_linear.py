"""bf16 matmuls on AMX through oneDNN with weights reordered once, at load: ``y = x W^T (+ bias)``.

Why: on a CPU with AMX, oneDNN (what ``F.linear`` runs in bf16) multiplies on the tile unit, but ``F.linear`` hands
it the weights in PyTorch's row-major layout, so every call first reorders the weight into the blocked layout the
tiles read: with a batch of decode rows the reorder costs more than the product. ``torch.ops.mkldnn`` exposes the
two halves separately (``_reorder_linear_weight`` once, ``_linear_pointwise`` per call; the pair PyTorch's own
compiler emits for frozen CPU models), so the reorder happens once per weight at load.

Measured (Xeon with AMX, 2 threads, bf16, SmolLM2's 210 linear layers + LM head per step, best of 5):

    rows                1     2     4     5     8    16    30    64   128   256   512  2000
    reordered once   12.5  12.3  12.7  13.4  13.6  14.7  17.5  29.8  28.0  46.1   109   310 ms
    F.linear         20.1  21.4  19.7  20.5  21.0  21.3  23.9  30.1  38.8  58.4  97.8   311 ms
    bf16_linear.py    9.2   9.7  10.9  17.9  18.0  32.7  65.0   118     -     -     -     - ms

(``bf16_linear.py`` then took the row-major weights; its pair panels since are faster, but not measured on AMX.)
So batches of ``MIN_ROWS`` to ``MAX_ROWS`` rows take the reordered weights, fewer rows keep our kernel (one or two
decode streams read 2 bytes a weight at the memory's rate), more keep ``F.linear`` (even at 2000 rows); where the
weight it wraps is pair panels (no dense copy to give ``F.linear``), the reordered weights take those too. Since
``amx_linear.py`` (our own tile kernel over the pair panels), pair-panel weights take the reordered copy only for
batches wider than ``amx_linear.MAX_ROWS`` (``linear.linear``): the tile kernel is faster up to about 128 rows, even
to 512, and gives a row the same bits in any batch.

Cost: the reordered copy is a second copy of the linear weights and the LM head (the one it wraps stays for the other
row counts); for SmolLM2 in bf16, +257 MiB. Only used where the CPU has AMX-BF16
(elsewhere oneDNN has no tile unit to feed, and the reorder does not pay) and PyTorch was built with oneDNN.

Exactness: oneDNN sums in its own blocked order, which can differ with the number of rows, so a bf16 row may not
give the same bits alone and in a batch. fp32 (where the engine guarantees batch invariance) never takes this path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device import cpu_flags
from engine.model.bf16_linear import Bf16Panels

if TYPE_CHECKING:
    from engine.model.packed import PackedWeight

MIN_ROWS = 5
MAX_ROWS = 256
# NOTE: the reorder takes the batch size it is tuned for; 16 (the decode batch of a busy server) measured best across
# 5-256 rows (a 16-row step 13.8 ms vs 25.5 tuned for 2000 and 33.8 tuned for 1).
_TUNED_ROWS = 16


@dataclass(frozen=True, slots=True)
class OneDnnWeight:
    """A bf16 linear weight held as it was (``base``: dense, GGUF blocks + dense, or pair panels) plus oneDNN's
    reordered copy."""

    base: torch.Tensor | PackedWeight | Bf16Panels
    reordered: torch.Tensor  # an opaque mkldnn tensor with the shape of ``dense``

    @property
    def dense(self) -> torch.Tensor:
        return self.base if isinstance(self.base, torch.Tensor) else self.base.dense

    @property
    def shape(self) -> torch.Size:
        return self.base.shape  # (not dense's: pair panels make a dense copy)


@functools.cache
def available() -> bool:
    """Whether weights should be reordered for oneDNN on this machine: AMX-BF16 and a oneDNN build of PyTorch."""
    if "amx_bf16" not in cpu_flags() or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def reorder(base: torch.Tensor | PackedWeight | Bf16Panels) -> OneDnnWeight:
    """``base`` plus its weights reordered for oneDNN (bf16, 2-D, on CPU)."""
    dense = base if isinstance(base, torch.Tensor) else base.dense
    if dense.dtype != torch.bfloat16 or dense.dim() != 2 or dense.device.type != "cpu":
        raise ValueError(f"oneDNN reorder needs a 2-D bf16 CPU weight, got {dense.dtype} {tuple(dense.shape)}")
    return OneDnnWeight(base, torch.ops.mkldnn._reorder_linear_weight(dense.contiguous(), _TUNED_ROWS))


def takes(x: torch.Tensor, bias: torch.Tensor | None, weight: OneDnnWeight) -> bool:
    """Whether ``linear`` takes this input: 2-D bf16 with ``MIN_ROWS..MAX_ROWS`` rows (any number from ``MIN_ROWS``
    where the weight's base is pair panels: there is no dense copy for ``F.linear`` then; the reordered weights took
    109 vs 98 ms at 512 rows, even at 2000), and a bf16 bias, if any."""
    wide = isinstance(weight.base, Bf16Panels)
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.shape[0] >= MIN_ROWS
        and (wide or x.shape[0] <= MAX_ROWS)
        and (bias is None or bias.dtype == torch.bfloat16)
    )


def linear(x: torch.Tensor, weight: OneDnnWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input of width {x.shape[-1]} for a weight of shape {tuple(weight.shape)}")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.reordered, bias, "none", [], "")
