"""The AVX512-BF16 pair-panel matmul kernel against float64, its batch invariance, the panel layout, and the
``linear`` dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import amx_linear, bf16_linear, kernels, linear
from engine.model.bf16_linear import Bf16Panels

needs_kernel = pytest.mark.skipif(
    kernels.library("bf16_panels") is None, reason="no AVX512-BF16 CPU (or no C compiler)"
)


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at each value's magnitude (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7)


def test_panels_hold_the_weight_sixteen_outputs_a_panel_in_input_pairs() -> None:
    w = torch.arange(33 * 6, dtype=torch.float32).view(33, 6).to(torch.bfloat16)
    p = bf16_linear.to_panels(w)
    assert p.panels.shape == (3, 3, 16, 2) and p.shape == (33, 6)  # ceil(33 / 16) panels, 3 input pairs
    assert float(p.panels[0, 1, 2, 0]) == float(w[2, 2]) and float(p.panels[0, 1, 2, 1]) == float(w[2, 3])
    assert float(p.panels[2, 2, 0, 1]) == float(w[32, 5])
    assert bool((p.panels[2, :, 1:] == 0).all())  # zeros past the last output
    assert torch.equal(p.dense, w)


def test_only_even_width_bf16_cpu_weights_become_panels() -> None:
    assert bf16_linear.convertible(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not bf16_linear.convertible(torch.zeros(8, 63, dtype=torch.bfloat16))
    assert not bf16_linear.convertible(torch.zeros(8, 64))
    assert not bf16_linear.convertible(torch.zeros(8, 4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even width"):
        bf16_linear.to_panels(torch.zeros(8, 63, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 30, 96, 130])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 7), (1536, 33), (6, 20)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_within_one_bf16_ulp_of_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    lib = kernels.library("bf16_panels")
    assert lib is not None
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    y = bf16_linear.linear(lib, x, bf16_linear.to_panels(w), bias)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    # one ulp of rounding, plus fp32 summation error over in_features products
    allowed = _ulp_bf16(exact) + 1e-6 * in_features * exact.abs().max()
    assert bool(((y.double() - exact).abs() <= allowed).all())


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    lib = kernels.library("bf16_panels")
    assert lib is not None
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(70, 576, generator=gen).to(torch.bfloat16)
    w = bf16_linear.to_panels(torch.randn(200, 576, generator=gen).to(torch.bfloat16))
    batch = bf16_linear.linear(lib, x, w)
    for i in (0, 3, 17, 29, 65):  # (the 70-row batch: grouped tiles; 1-9 rows: the panel loop)
        for rows in (1, 2, 3, 4, 5, 9):
            assert torch.equal(bf16_linear.linear(lib, x[i : i + rows], w)[:1], batch[i : i + 1])
    # every row tiling of the panel loop (16s, then two tiles of 5-8 rows or one of 1-8), every row of it
    for rows in range(1, 41):
        assert torch.equal(bf16_linear.linear(lib, x[5 : 5 + rows], w), batch[5 : 5 + rows])


@needs_kernel
def test_non_finite_inputs_stay_non_finite_and_no_rows_give_none() -> None:
    lib = kernels.library("bf16_panels")
    assert lib is not None
    x = torch.ones(5, 64, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    w = bf16_linear.to_panels(torch.ones(20, 64, dtype=torch.bfloat16))
    y = bf16_linear.linear(lib, x, w)
    assert bool(y[1].isnan().all()) and bool(y[2].isinf().all())
    assert bool((y[[0, 3, 4]] == 64).all())
    assert bf16_linear.linear(lib, x[:0], w).shape == (0, 20)


@needs_kernel
def test_kernel_refuses_an_input_that_does_not_fit() -> None:
    lib = kernels.library("bf16_panels")
    assert lib is not None
    w = bf16_linear.to_panels(torch.ones(20, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot take"):
        bf16_linear.linear(lib, torch.ones(2, 62, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="cannot take"):
        bf16_linear.linear(lib, torch.ones(2, 64), w)
    with pytest.raises(ValueError, match="cannot take a bias"):
        bf16_linear.linear(lib, torch.ones(2, 64, dtype=torch.bfloat16), w, torch.zeros(16))


@needs_kernel
def test_linear_dispatches_panels_to_the_kernel_and_dense_weights_to_f_linear() -> None:
    lib = kernels.library("bf16_panels")
    assert lib is not None
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    panels = bf16_linear.to_panels(w)
    amx = kernels.library("amx_panels")  # (on a CPU with AMX the tile kernel takes these batches: test_amx_linear.py)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        kernel = bf16_linear.linear(lib, x, panels) if amx is None else amx_linear.run(amx, x, panels)
        assert torch.equal(linear.linear(x, panels), kernel)
        assert torch.equal(linear.linear(x, w), F.linear(x, w))
    assert isinstance(panels, Bf16Panels) and torch.equal(linear.dense(panels), w)
