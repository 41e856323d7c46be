"""The few-row AVX512-BF16 matmul kernel against float64, its batch invariance, and the ``linear`` dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import bf16_linear, linear
from engine.model.packed import PackedWeight

needs_kernel = pytest.mark.skipif(bf16_linear.load() is None, reason="no AVX512-BF16 CPU (or no C compiler)")


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at each value's magnitude (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 30, 96])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 7), (1536, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_within_one_bf16_ulp_of_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    lib = bf16_linear.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    y = bf16_linear.linear(lib, x, w, bias)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    # one ulp of rounding, plus fp32 summation error over in_features products
    allowed = _ulp_bf16(exact) + 1e-6 * in_features * exact.abs().max()
    assert bool(((y.double() - exact).abs() <= allowed).all())


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    lib = bf16_linear.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(30, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(200, 576, generator=gen).to(torch.bfloat16)
    batch = bf16_linear.linear(lib, x, w)
    for i in (0, 3, 17, 29):
        assert torch.equal(bf16_linear.linear(lib, x[i : i + 1], w), batch[i : i + 1])
        assert torch.equal(bf16_linear.linear(lib, x[i : i + 2], w)[:1], batch[i : i + 1])


@needs_kernel
def test_non_finite_inputs_stay_non_finite() -> None:
    lib = bf16_linear.load()
    assert lib is not None
    x = torch.ones(5, 64, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    w = torch.ones(20, 64, dtype=torch.bfloat16)
    y = bf16_linear.linear(lib, x, w)
    assert bool(y[1].isnan().all()) and bool(y[2].isinf().all())
    assert bool((y[[0, 3, 4]] == 64).all())


def test_fits_only_what_the_kernel_takes() -> None:
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert bf16_linear.fits(x, w, None)
    assert not bf16_linear.fits(x.float(), w.float(), None)
    assert not bf16_linear.fits(
        torch.zeros(4, 48, dtype=torch.bfloat16), torch.zeros(8, 48, dtype=torch.bfloat16), None
    )
    assert not bf16_linear.fits(torch.zeros(bf16_linear.MAX_ROWS + 1, 64, dtype=torch.bfloat16), w, None)
    assert not bf16_linear.fits(torch.zeros(0, 64, dtype=torch.bfloat16), w, None)
    assert not bf16_linear.fits(x, w.t().contiguous().t(), None)  # a transposed (non-contiguous) weight
    assert not bf16_linear.fits(x, w, torch.zeros(7))


@needs_kernel
def test_linear_dispatches_bf16_rows_to_the_kernel_dense_and_packed() -> None:
    lib = bf16_linear.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    for rows in (1, 16):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(linear.linear(x, w), bf16_linear.linear(lib, x, w))
        packed = PackedWeight(blocks=torch.zeros(40, 1, dtype=torch.uint8), fmt="q8_0", dense=w)
        assert torch.equal(linear.linear(x, packed), bf16_linear.linear(lib, x, w))
    big = torch.randn(bf16_linear.MAX_ROWS + 1, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear.linear(big, w), F.linear(big, w))
