"""oneDNN's reordered bf16 weights (AMX): results against float64, the ``linear`` dispatch by batch size, the
whole-model conversion, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model import amx_linear, bf16_linear, linear, onednn_linear
from engine.model.bf16_linear import Bf16Panels
from engine.model.onednn_linear import OneDnnWeight
from engine.model.packed import PackedWeight
from engine.model_runner import BatchItem, ModelRunner
from engine.testing import build_tiny_model

needs_amx = pytest.mark.skipif(not onednn_linear.available(), reason="no AMX-BF16 CPU (or PyTorch without oneDNN)")


def _q8_0_weight(gen: torch.Generator, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight and q8_0 blocks that hold it exactly (d = 1/16, so every d * q is a bf16 value)."""
    q = torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=gen, dtype=torch.int8)
    d = torch.full((out_features, in_features // 32, 1), 1 / 16, dtype=torch.float16).view(torch.uint8)
    blocks = torch.cat([d, q.view(torch.uint8)], dim=-1).reshape(out_features, -1).contiguous()
    return (q.float() / 16).reshape(out_features, in_features).to(torch.bfloat16), blocks


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7)


@needs_amx
@pytest.mark.parametrize("rows", [onednn_linear.MIN_ROWS, 16, 30, 100, onednn_linear.MAX_ROWS])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 7), (1536, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reordered_weights_are_within_one_bf16_ulp_of_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    y = onednn_linear.linear(x, onednn_linear.reorder(w), bias)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    allowed = _ulp_bf16(exact) + 1e-6 * in_features * exact.abs().max()
    assert bool(((y.double() - exact).abs() <= allowed).all())


@needs_amx
def test_linear_takes_the_reordered_copy_only_for_its_batch_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    dense, q8_blocks = _q8_0_weight(gen, 40, 64)
    blocks = PackedWeight(blocks=q8_blocks, fmt="q8_0", dense=dense)
    calls: list[int] = []
    real = onednn_linear.linear

    def spy(x: torch.Tensor, weight: OneDnnWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(onednn_linear, "linear", spy)
    bases: list[torch.Tensor | PackedWeight | Bf16Panels] = [dense, blocks]
    if bf16_linear.load() is not None:
        bases.append(bf16_linear.to_panels(dense))
    for base in bases:
        w = onednn_linear.reorder(base)
        assert w.base is base and torch.equal(linear.dense(w), dense) and w.shape == dense.shape
        rows_tried = (1, onednn_linear.MIN_ROWS - 1, onednn_linear.MIN_ROWS, 64, onednn_linear.MAX_ROWS + 1, 600)
        for rows in rows_tried:
            x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
            y = linear.linear(x, w)
            # (over MAX_ROWS too where the base is pair panels: there is no dense copy for F.linear; but not the
            # batches the AMX tile kernel takes from pair panels)
            wide = isinstance(base, Bf16Panels)
            tiles = wide and amx_linear.load() is not None and amx_linear.takes(x, base)
            if not tiles and rows >= onednn_linear.MIN_ROWS and (wide or rows <= onednn_linear.MAX_ROWS):
                assert calls.pop() == rows
            else:  # what the wrapped weight gives on its own
                assert not calls
                assert torch.equal(y, linear.linear(x, base))
            assert torch.allclose(y.float(), F.linear(x, dense).float(), rtol=2e-2, atol=2e-2)


def test_reorder_refuses_weights_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="2-D bf16 CPU weight"):
        onednn_linear.reorder(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="2-D bf16 CPU weight"):
        onednn_linear.reorder(torch.zeros(8, dtype=torch.bfloat16))


def test_takes_only_2d_bf16_batches_in_range() -> None:
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    dense = torch.zeros(8, 64, dtype=torch.bfloat16)
    w = OneDnnWeight(dense, torch.empty(0))  # (the reordered copy is not read here)
    assert onednn_linear.takes(x, None, w)
    assert onednn_linear.takes(x, torch.zeros(8, dtype=torch.bfloat16), w)
    assert not onednn_linear.takes(x, torch.zeros(8), w)  # an fp32 bias
    assert not onednn_linear.takes(x.float(), None, w)
    assert not onednn_linear.takes(x.view(4, 4, 64), None, w)
    assert not onednn_linear.takes(x[: onednn_linear.MIN_ROWS - 1], None, w)
    wide = torch.zeros(onednn_linear.MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert not onednn_linear.takes(wide, None, w)
    # over pair panels (no dense copy for F.linear) every batch from MIN_ROWS rows
    panels = OneDnnWeight(bf16_linear.to_panels(dense), torch.empty(0))
    assert onednn_linear.takes(wide, None, panels) and onednn_linear.takes(x, None, panels)
    assert not onednn_linear.takes(x[: onednn_linear.MIN_ROWS - 1], None, panels)


def test_available_needs_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    check = onednn_linear.available.__wrapped__
    monkeypatch.setattr(onednn_linear, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not check()
    monkeypatch.setattr(onednn_linear, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert check() == torch.backends.mkldnn.is_available()


@needs_amx
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias goes through oneDNN too
def test_a_bf16_model_with_reordered_weights_gives_the_same_logits(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_tiny_model(tmp_path / arch, arch)
    runner = ModelRunner(folder, num_blocks=8, block_size=16, device="cpu", dtype="bfloat16")
    weights = runner.model.weights
    assert weights.num_reordered == 4 * len(weights.layers) + 1  # every linear layer and the LM head
    assert weights.with_onednn().num_reordered == weights.num_reordered  # idempotent
    monkeypatch.setattr(onednn_linear, "available", lambda: False)
    plain = ModelRunner(folder, num_blocks=8, block_size=16, device="cpu", dtype="bfloat16")
    assert plain.model.weights.num_reordered == 0
    prompt = list(range(3, 3 + 24))  # 24 rows: the reordered copies
    for items in ([BatchItem(prompt, 0, [0, 1], True)], [BatchItem([30], 24, [0, 1], True)]):  # then one decode row
        got, ref = runner.forward(items), plain.forward(items)
        assert torch.allclose(got, ref, atol=0.05, rtol=0.05)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
