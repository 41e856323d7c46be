"""The fp32 panel matmul kernel against float64, its batch invariance, the panel layout, and the ``linear`` dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.device import cpu_flags
from engine.model import build, kernels, linear, panel_linear
from engine.model.panel_linear import PanelWeight, to_panels

needs_kernel = pytest.mark.skipif(
    kernels.library("panel_linear") is None, reason="not an x86 CPU with AVX2 and FMA (or no compiler)"
)


def test_panels_hold_the_weight_column_slices_and_give_it_back() -> None:
    w = torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5)
    pw = to_panels(w)
    assert pw.panels.shape == (3, 5, 16) and pw.shape == (37, 5) and pw.out_features == 37
    assert torch.equal(pw.panels[1, 2], w[16:32, 2])  # panel 1, input 2: outputs 16..31
    assert torch.equal(pw.panels[2, 4, :5], w[32:, 4])
    assert bool((pw.panels[2, :, 5:] == 0).all())  # padding past the last output
    assert torch.equal(pw.dense, w) and pw.dense.is_contiguous()


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 16, 30, 31, 32, 33, 100, 200])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (7, 33), (1536, 16), (64, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64(rows: int, in_features: int, out_features: int, with_bias: bool) -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    gen = torch.Generator().manual_seed(rows * 31 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    y = panel_linear.linear(lib, x, to_panels(w), bias)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    # fp32 rounding of a sequential sum of in_features products of unit-normal values
    allowed = 1e-6 * in_features * (1 + exact.abs())
    assert bool(((y.double() - exact).abs() <= allowed).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])
def test_a_long_sum_is_summed_by_slices(rows: int) -> None:
    # 8192 products of 0.1: one fp32 chain over k drifts 6.5e-5 (relative) from the exact sum; chains of KS = 64
    # products added slice by slice stay within 1e-6 (the plain and the blocked form alike)
    lib = kernels.library("panel_linear")
    assert lib is not None
    x = torch.full((rows, 8192), 0.1)
    y = panel_linear.linear(lib, x, to_panels(torch.ones(3, 8192)))
    exact = x.double().sum(dim=1, keepdim=True)
    assert float(((y.double() - exact).abs() / exact).max()) < 1e-6


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(31, 576, generator=gen)
    pw = to_panels(torch.randn(200, 576, generator=gen))
    batch = panel_linear.linear(lib, x, pw)
    # every tile shape (6, 5, 4, 3, 2 and 1 rows) computes row i in the same order
    for i in (0, 5, 12, 29, 30):
        for n in (1, 2, 3, 4, 5, 6, 7):
            if i + n <= 31:
                assert torch.equal(panel_linear.linear(lib, x[i : i + n], pw)[0], batch[i])
    for n in range(1, 32):  # every row tiling, every row of it
        assert torch.equal(panel_linear.linear(lib, x[:n], pw), batch[:n])


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="no AVX-512: the native build is the AVX2 one")
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 40, 200])
def test_an_avx512_build_gives_the_bits_of_an_avx2_build(rows: int) -> None:
    # a build for Haswell (AVX2 + FMA: a panel is two 8-lane vectors) against the native one (one 16-lane vector):
    # the same weights give the same bits on either kind of machine
    haswell = build.open_library("panel_linear", "nothing (the test fails)", ["-march=haswell"])
    lib = kernels.library("panel_linear")
    assert haswell is not None and lib is not None
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1300, generator=gen)
    pw = to_panels(torch.randn(70, 1300, generator=gen))
    bias = torch.randn(70, generator=gen)
    expected = panel_linear.linear(panel_linear.bind(haswell), x, pw, bias)
    assert torch.equal(panel_linear.linear(lib, x, pw, bias), expected)


@needs_kernel
@pytest.mark.parametrize(
    ("in_features", "out_features", "with_bias"), [(576, 200, False), (1536, 33, True), (1300, 40, True)]
)
def test_the_blocked_form_gives_each_row_the_same_bits_as_the_small_batches(
    in_features: int, out_features: int, with_bias: bool
) -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    gen = torch.Generator().manual_seed(in_features)
    rows = 192 + 59  # two row blocks (MC = 192); k whole (576) or in slices (1536 = 3 x 512, 1300 = 448 + 448 + 404)
    x = torch.randn(rows, in_features, generator=gen)
    pw = to_panels(torch.randn(out_features, in_features, generator=gen))
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    assert rows >= panel_linear.BLOCKED_MIN_ROWS > 7
    batch = panel_linear.linear(lib, x, pw, bias)
    assert batch.shape == (rows, out_features) and batch.is_contiguous()
    for i in (0, 5, 95, 96, 191, 192, 250):
        for n in (1, 2, 4, 6, 7, panel_linear.BLOCKED_MIN_ROWS, 40):
            if i + n <= rows:
                assert torch.equal(panel_linear.linear(lib, x[i : i + n], pw, bias)[0], batch[i])


@needs_kernel
@pytest.mark.parametrize("rows", [5, 40])
def test_non_finite_inputs_stay_non_finite(rows: int) -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    x = torch.ones(rows, 300)
    x[1, 3] = float("nan")
    x[2, 299] = float("inf")
    y = panel_linear.linear(lib, x, to_panels(torch.ones(20, 300)))
    assert bool(y[1].isnan().all()) and bool(y[2].isinf().all())
    assert bool((y[[0, 3, 4]] == 300).all())


@needs_kernel
def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    pw = to_panels(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="cannot take"):
        panel_linear.linear(lib, torch.zeros(2, 48), pw)
    with pytest.raises(ValueError, match="cannot take"):
        panel_linear.linear(lib, torch.zeros(2, 64, dtype=torch.bfloat16), pw)


@needs_kernel
def test_linear_takes_the_panels_for_every_batch_size() -> None:
    lib = kernels.library("panel_linear")
    assert lib is not None
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen)
    pw = to_panels(w)
    assert isinstance(pw, PanelWeight)
    for rows in (1, 2, 3, 5, panel_linear.BLOCKED_MIN_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        y = linear.linear(x, pw)
        assert torch.equal(y, panel_linear.linear(lib, x, pw))
        assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert linear.linear(torch.zeros(0, 64), pw).shape == (0, 48)
    assert torch.equal(linear.dense(pw), w)
