"""bf16 matmuls on AMX tiles straight from the pair panels of ``bf16_linear.py``: ``y = x W^T (+ bias)``.

A tile multiply (``tdpbf16ps``) takes a 16 x 32 block of ``x`` and a 32 x 16 block of the weights, which is exactly 16
consecutive lines of a pair panel: the tiles read the panels in place, no second copy of the weights.

NOTE: every output is the accumulator tile's chain over the 32-input chunks in order, then ``+ bias`` and one rounding,
whatever the batch, so a row gives the same bits alone and in any batch. Those are not ``vdpbf16ps``'s bits, so on a
CPU with AMX a weight whose input width is a multiple of 32 takes this kernel for every batch. Linux lends the tile
registers to a process that asks (``arch_prctl``); ``load`` asks once and returns None where the kernel refuses.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from engine.model import bf16_linear
from engine.model.bf16_linear import Bf16Panels
from engine.model.build import open_library

log = logging.getLogger(__name__)

CHUNK = 32  # inputs per tile multiply: the input width must be a multiple


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel with the tiles granted; None where kernels are disabled, the build fails or the kernel
    refuses the tiles (logged). ``kernels.library("amx_panels")`` asks only on a CPU the table's AMX rows are for."""
    lib = open_library("amx_panels", "the AVX512-BF16 pair-panel kernel")
    if lib is None:
        return None
    status = lib.kvchat_amx_init()
    if status != 0:
        log.warning("AMX tiles refused by the kernel (status %d); using the AVX512-BF16 pair-panel kernel", status)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvchat_amx_panels.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.kvchat_amx_panels.restype = ctypes.c_int
    return lib


def takes(x: torch.Tensor, weight: Bf16Panels) -> bool:
    """Whether ``run`` takes this input for this weight: 2-D bf16, at least one row, an input width that is a multiple
    of ``CHUNK`` (where it is not, the weight keeps ``bf16_linear.py`` for every batch)."""
    in_features = 2 * weight.panels.shape[1]
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.shape[0] >= 1
        and x.shape[1] == in_features
        and in_features % CHUNK == 0
    )


def run(lib: ctypes.CDLL, x: torch.Tensor, weight: Bf16Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dense, bias)`` for an input ``takes`` accepts (the caller checks)."""
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"pair panel weight {tuple(weight.shape)} cannot take a bias of shape {tuple(bias.shape)}")
    y, status = bf16_linear.call(lib.kvchat_amx_panels, x, weight, bias)
    if status not in (0, None):  # (None: no rows, the kernel was not called)
        raise MemoryError("AMX kernel: out of memory for its copy of the input")
    return y
