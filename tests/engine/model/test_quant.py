"""Opt-in weight-only int8: close to the unquantized model (not exact), both row-count paths agree, bad config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.model import kernels
from engine.model.linear import linear
from engine.model.quant import Int8Weight, quantize
from engine.model_runner import BatchItem, ModelRunner
from engine.sampling_params import SamplingParams


def test_quantize_is_symmetric_per_channel_and_both_paths_agree() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    qw = quantize(w)
    assert isinstance(qw, Int8Weight)
    assert qw.q.dtype == torch.int8
    assert int(qw.q.abs().max()) == 127
    assert torch.allclose(qw.dense.float(), w.float(), atol=float(w.abs().max()) / 127)
    rows = kernels.row_limit("int8pack_mm", torch.bfloat16)
    few = torch.randn(rows, 32, dtype=torch.bfloat16)
    many = torch.cat([few, torch.randn(40, 32, dtype=torch.bfloat16)])
    small = linear(few, qw)  # the table's int8pack_mm row
    wide = linear(many, qw)[:rows]  # F.linear on the dequantized copy
    assert torch.equal(small, torch.ops.aten._weight_int8pack_mm(few, qw.q, qw.scales))
    assert torch.equal(wide, torch.nn.functional.linear(many, qw.dense)[:rows])
    assert torch.allclose(small.float(), wide.float(), rtol=0.02, atol=0.05)


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.forward([BatchItem(ids, 0, [0, 1], need_logits=True)])[0]


def test_int8_runner_stays_close_to_bf16(tiny_model_dir: Path) -> None:
    base = ModelRunner.from_config(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_kv_memory_mb=1))
    q8 = ModelRunner.from_config(
        EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_kv_memory_mb=1, quantization="int8")
    )
    ids = list(range(3, 23))
    a, b = _logits(base, ids), _logits(q8, ids)
    rel = float((a - b).norm() / a.norm())
    assert rel < 0.05
    assert rel > 0  # it really is a different (quantized) model


def test_int8_engine_generates_and_reuses_its_cache(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_kv_memory_mb=4, quantization="int8")
    )
    prompt = list(range(5, 45))
    first, second = (engine.generate_sync([prompt], SamplingParams(max_tokens=6))[0] for _ in range(2))
    assert first.stats.completion_tokens == 6
    assert second.stats.cached_tokens == 32


def test_bad_quantization_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="quantization='int4'"):
        EngineConfig(quantization="int4")
