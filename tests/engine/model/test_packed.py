"""Packed GGUF weights: the kernel dequantizes exactly as gguf does, computes the dense matmul, and is only used
where it reproduces the dense weights bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.model import kernels, packed
from engine.model.linear import linear
from engine.model.packed import PackedWeight, pack

PACKED_MAX_ROWS = kernels.row_limit("gguf_blocks", torch.float32)
PACKED_MAX_ROWS_BF16 = kernels.row_limit("gguf_blocks", torch.bfloat16)

FORMATS = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}

pytestmark = pytest.mark.skipif(kernels.library("packed_linear") is None, reason="no C compiler for the packed kernel")


def _blocks(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks, their exact fp32 dequantization) of a random weight, made by gguf itself."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    raw = quantize(values, FORMATS[fmt])
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, FORMATS[fmt]).copy())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kernel_dequantizes_exactly_as_gguf(fmt: str) -> None:
    lib = kernels.library("packed_linear")
    assert lib is not None
    blocks, dense = _blocks(fmt, 37, 96)
    assert tuple(blocks.shape) == (37, packed.row_bytes(fmt, 96))
    assert torch.equal(packed.dequantize(lib, blocks, fmt, 96, bf16=False), dense)
    assert torch.equal(packed.dequantize(lib, blocks, fmt, 96, bf16=True), dense.bfloat16().float())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, PACKED_MAX_ROWS])
def test_linear_matches_the_dense_matmul_fp32(fmt: str, rows: int) -> None:
    blocks, dense = _blocks(fmt, 37, 96, seed=rows)  # an odd number of outputs exercises every tail
    weight = pack([(blocks, fmt)], dense)
    assert isinstance(weight, PackedWeight)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    torch.testing.assert_close(linear(x, weight), F.linear(x, dense), rtol=0, atol=1e-5)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, dense, bias), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])  # fused (1-2 rows) and tiled (3-4) kernel paths
def test_linear_bf16_rounds_like_a_bf16_matmul(rows: int) -> None:
    blocks, dense32 = _blocks("q4_1", 40, 64)
    dense = dense32.bfloat16()
    weight = pack([(blocks, "q4_1")], dense)
    assert weight is not None
    x = torch.randn(rows, 64).bfloat16()
    out = linear(x, weight)
    assert out.dtype == torch.bfloat16
    # the exact fp32 product of the same bf16 weights, rounded once: at most one bf16 ulp apart
    exact = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(out.float(), exact.bfloat16().float(), rtol=2**-7, atol=1e-3)


def test_wide_batches_use_the_dense_weights() -> None:
    blocks, dense = _blocks("q8_0", 16, 64)
    weight = pack([(blocks, "q8_0")], dense)
    assert weight is not None
    x = torch.randn(PACKED_MAX_ROWS + 1, 64)
    assert torch.equal(linear(x, weight), F.linear(x, dense))


def test_fused_parts_are_stacked_in_order() -> None:
    q, dq = _blocks("q4_1", 8, 64, seed=1)
    k, dk = _blocks("q4_1", 4, 64, seed=2)
    weight = pack([(q, "q4_1"), (k, "q4_1")], torch.cat([dq, dk]))
    assert weight is not None
    assert torch.equal(weight.blocks, torch.cat([q, k]))
    assert weight.shape == (12, 64)


def test_pack_refuses_blocks_that_are_not_exactly_the_dense_weights() -> None:
    blocks, dense = _blocks("q4_1", 8, 64)
    off = dense.clone()
    off[3, 17] = torch.nextafter(off[3, 17], torch.tensor(1.0))  # one ulp
    assert pack([(blocks, "q4_1")], off) is None
    assert pack([(blocks, "q4_1")], dense.bfloat16()) is not None  # the bf16 model rounds the same weights


def test_pack_refuses_mixed_formats_bad_shapes_and_unknown_formats() -> None:
    q, dq = _blocks("q4_1", 8, 64)
    k, dk = _blocks("q8_0", 4, 64)
    assert pack([(q, "q4_1"), (k, "q8_0")], torch.cat([dq, dk])) is None
    assert pack([(q, "q4_1")], torch.cat([dq, dq])) is None  # twice the rows
    assert pack([(q, "q5_k")], dq) is None
    assert pack([(q[:, :-1], "q4_1")], dq) is None  # truncated rows


def test_without_the_kernel_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, dense = _blocks("q4_1", 8, 64)
    monkeypatch.setattr(packed, "load", lambda: None)
    assert pack([(blocks, "q4_1")], dense) is None


def test_bf16_batches_wider_than_their_limit_use_the_dense_weights() -> None:
    blocks, dense32 = _blocks("q4_1", 16, 64)
    weight = pack([(blocks, "q4_1")], dense32.bfloat16())
    assert weight is not None
    x = torch.randn(PACKED_MAX_ROWS_BF16 + 1, 64).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight.dense))
