"""ModelRunner bookkeeping: sizes, budgets, input checks, block copy, dtype resolution (tiny random Qwen2, fp32)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.device import cpu_flags, resolve_dtype
from engine.errors import InvalidRequestError, ModelLoadError
from engine.model import huge_pages, kernels
from engine.model.bf16_linear import Bf16Panels
from engine.model.huge_pages import HUGE_PAGE
from engine.model.panel_linear import PanelWeight
from engine.model.spec import ModelSpec
from engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_token, num_blocks_for_budget

CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 40,
    "eos_token_id": 5,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(Qwen2Config(**CONFIG)).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    return path


@pytest.fixture
def runner(folder: Path) -> ModelRunner:
    return ModelRunner(folder, num_blocks=8, block_size=4, device="cpu", dtype="float32")


def test_sizes(runner: ModelRunner) -> None:
    assert runner.vocab_size == 64
    assert runner.max_model_len == 40
    assert runner.eos_token_ids == (5, 7)
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # layers * (k, v) * kv_heads * head_dim * fp32
    assert runner.kv_pool.shape == (2, 2, 8, 4, 2, 8)


def test_pool_and_weights_are_in_huge_pages(runner: ModelRunner) -> None:
    if not huge_pages.available():
        pytest.skip("no mmap.madvise(MADV_HUGEPAGE) here")
    assert runner.kv_pool.data_ptr() % HUGE_PAGE == 0
    weights = runner.model.weights
    assert weights.embed.data_ptr() % HUGE_PAGE == 0  # (a mapping of its own)
    assert (weights.lm_head is weights.embed) == runner.spec.tie_word_embeddings
    tied = dataclasses.replace(weights, lm_head=weights.embed).in_huge_pages()
    assert tied.lm_head is tied.embed and tied.embed is not weights.embed  # (tied embeddings: still one tensor)
    assert torch.equal(tied.embed, weights.embed)
    layer = weights.layers[0]

    def tensor(w: object) -> torch.Tensor:  # dense, or fp32 panels where the panel kernel runs (AVX2 CPUs, AVX-512 too)
        held = w.panels if isinstance(w, PanelWeight) else w
        assert isinstance(held, torch.Tensor)
        return held

    first = tensor(layer.qkv if weights.lm_head is weights.embed else weights.lm_head)  # (the linear weights' first)
    assert first.data_ptr() % HUGE_PAGE == 0
    base = first.data_ptr()
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down, weights.layers[-1].down):
        assert base <= tensor(w).data_ptr() < base + (64 << 20)  # in the same mapping


@pytest.mark.skipif(kernels.library("bf16_panels") is None, reason="no AVX512-BF16 CPU (or no C compiler)")
def test_bf16_linear_weights_are_pair_panels_in_huge_pages(folder: Path) -> None:
    bf16 = ModelRunner(folder, num_blocks=8, block_size=4, device="cpu", dtype="bfloat16")
    dense = ModelRunner(folder, num_blocks=8, block_size=4, device="cpu", dtype="float32").model.weights
    weights = bf16.model.weights

    def panels(w: object) -> Bf16Panels:
        assert isinstance(w, Bf16Panels)
        return w

    linear = [panels(weights.lm_head)] + [
        panels(w) for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert weights.num_panels == len(linear)
    assert isinstance(weights.embed, torch.Tensor)  # (the table stays dense for the lookup; a tied head: a panel copy)

    def fp32(w: object) -> torch.Tensor:  # dense, or fp32 panels (every CPU with AVX512-BF16 has AVX2)
        held = w.dense if isinstance(w, PanelWeight) else w
        assert isinstance(held, torch.Tensor) and held.dtype == torch.float32
        return held

    assert torch.equal(linear[0].dense, fp32(dense.lm_head).to(torch.bfloat16))
    assert torch.equal(panels(weights.layers[1].down).dense, fp32(dense.layers[1].down).to(torch.bfloat16))
    if huge_pages.available():
        first = linear[0].panels
        assert first.data_ptr() % HUGE_PAGE == 0
        for w in linear:
            assert first.data_ptr() <= w.panels.data_ptr() < first.data_ptr() + (64 << 20)  # in the same mapping
    ids = [3, 9, 12, 40]
    out = bf16.forward([BatchItem(ids, 0, [0], True)])
    ref = ModelRunner(folder, num_blocks=8, block_size=4, device="cpu", dtype="float32").forward(
        [BatchItem(ids, 0, [0], True)]
    )
    assert (out - ref).abs().max().item() < 0.1  # (bf16 against fp32)


def test_num_blocks_for_budget() -> None:
    spec = ModelSpec.from_hf_config({**CONFIG, "model_type": "qwen2"})
    per_block = kv_bytes_per_token(spec, torch.bfloat16) * 16
    assert num_blocks_for_budget(spec, 1, 16, torch.bfloat16) == (1 << 20) // per_block
    big = ModelSpec.from_hf_config({**CONFIG, "model_type": "qwen2", "num_hidden_layers": 4096})
    with pytest.raises(InvalidRequestError, match="holds no KV block"):
        num_blocks_for_budget(big, 1, 1024, torch.float32)


def test_empty_batch(runner: ModelRunner) -> None:
    assert runner.forward([]).shape == (0, 64)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (BatchItem([], 0, [0], True), "needs >= 1 token"),
        (BatchItem([1] * 5, 0, [0], True), "cannot hold 5 tokens"),
        (BatchItem([64], 0, [0], True), "token id out of range"),
        (BatchItem([1], 0, [8], True), "block id out of range"),
        (BatchItem([1], 40, [0] * 11, True), "beyond max_model_len=40"),
    ],
)
def test_bad_items_are_rejected(runner: ModelRunner, item: BatchItem, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runner.forward([item])


def test_blocks_can_be_moved_and_restored(runner: ModelRunner) -> None:
    ids = [3, 1, 4, 1, 5, 9]
    runner.forward([BatchItem(ids[:-1], 0, [2, 6], False)])
    expected = runner.forward([BatchItem(ids[-1:], 5, [2, 6], True)])
    saved = runner.read_blocks([2, 6])
    runner.kv_pool.fill_(0.5)  # another sequence overwrote them
    # restored into different physical blocks; NOTE: again not one consecutive run, so the same attention path
    # (a consecutive table takes SDPA over a view, whose fp32 sums may round differently than the C kernel's)
    runner.write_blocks([7, 0], saved)
    assert torch.equal(runner.forward([BatchItem(ids[-1:], 5, [7, 0], True)]), expected)


def test_only_rows_that_need_logits(runner: ModelRunner) -> None:
    out = runner.forward([BatchItem([1, 2], 0, [0], False), BatchItem([3], 0, [1], True)])
    assert out.shape == (1, 64)
    assert out.dtype == torch.float32


def test_dtype_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    bf16_cpu = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if bf16_cpu else torch.float32)
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        resolve_dtype("int4", cpu)


def test_bf16_runner_is_close_to_fp32(folder: Path) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    out = {}
    for dtype in ("float32", "bfloat16"):
        r = ModelRunner(folder, num_blocks=8, block_size=4, device="cpu", dtype=dtype)
        out[dtype] = r.forward([BatchItem(ids, 0, [5, 1], True)])
    assert (out["float32"] - out["bfloat16"]).abs().max().item() < 0.1
