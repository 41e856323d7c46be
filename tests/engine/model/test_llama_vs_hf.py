"""Our paged forward against transformers, in fp32, for tiny random models of every supported architecture.

Each case compares logits (max abs diff <= 1e-4) for: a full prefill, step-by-step decode through a shuffled
(non-contiguous) block table, a prefill split into chunks at positions not aligned to blocks, and a mixed batch (one
prefill + two decodes in one forward) against each sequence run alone. The decode cases run twice: through the C
paged-decode kernel (where a compiler is present) and through the pure-torch fallback.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.model import cpu_kernels
from engine.model_runner import BatchItem, ModelRunner

TOL = 1e-4
BLOCK = 4
NUM_BLOCKS = 64
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}

CASES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=500.0)),
    "llama3_rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    "llama_tied_bias": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24)),
}


def _randomize(model: PreTrainedModel) -> None:
    # NOTE: HF initialises norms to 1 and biases to 0, which would hide a missing norm weight or bias in our loader.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    model = CASES[request.param]().eval()
    _randomize(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    return str(request.param)


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(path, num_blocks=NUM_BLOCKS, block_size=BLOCK, device="cpu", dtype="float32")


def _hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(COMMON["vocab_size"]) for _ in range(n)]


def _table(n_tokens: int, rng: random.Random, free: list[int]) -> list[int]:
    n_blocks = -(-n_tokens // BLOCK)
    picked = free[:n_blocks]
    del free[:n_blocks]
    rng.shuffle(picked)
    return picked


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff}"


def test_full_prefill_matches_hf(case: tuple[PreTrainedModel, Path]) -> None:
    model, path = case
    runner = _runner(path)
    ids = _tokens(23, seed=1)
    table = _table(len(ids), random.Random(1), list(range(NUM_BLOCKS)))
    ref = _hf_logits(model, ids)
    out = runner.forward([BatchItem(ids, 0, table, need_logits=True)])
    _close(out, ref[-1:])


def test_stepwise_decode_through_shuffled_pool_matches_hf(case: tuple[PreTrainedModel, Path], decode_path: str) -> None:
    model, path = case
    runner = _runner(path)
    ids = _tokens(30, seed=2)
    free = list(range(NUM_BLOCKS))
    random.Random(2).shuffle(free)
    table = _table(len(ids), random.Random(2), free)
    ref = _hf_logits(model, ids)
    steps = [runner.forward([BatchItem([tok], pos, table, need_logits=True)])[0] for pos, tok in enumerate(ids)]
    _close(torch.stack(steps), ref)


def test_stepwise_decode_contiguous_table_matches_hf(case: tuple[PreTrainedModel, Path], decode_path: str) -> None:
    # a table that is one run of consecutive blocks is read as a view of the pool (no gather)
    model, path = case
    runner = _runner(path)
    ids = _tokens(13, seed=9)
    table = [9, 10, 11, 12]
    ref = _hf_logits(model, ids)
    steps = [runner.forward([BatchItem([tok], pos, table, need_logits=True)])[0] for pos, tok in enumerate(ids)]
    _close(torch.stack(steps), ref)


def test_chunked_prefill_unaligned_matches_hf(case: tuple[PreTrainedModel, Path]) -> None:
    model, path = case
    runner = _runner(path)
    ids = _tokens(29, seed=3)
    table = _table(len(ids), random.Random(3), list(range(5, NUM_BLOCKS)))
    ref = _hf_logits(model, ids)
    cuts = [0, 3, 10, 11, 22, 29]  # 3, 10, 11, 22 are not multiples of BLOCK
    outs = []
    for start, end in itertools.pairwise(cuts):
        item = BatchItem(ids[start:end], start, table, need_logits=True)
        outs.append(runner.forward([item])[0])
    _close(torch.stack(outs), ref[[c - 1 for c in cuts[1:]]])
    # a chunk that does not end the prompt produces no logits row
    assert runner.forward([BatchItem(ids[:5], 0, table, need_logits=False)]).shape == (0, COMMON["vocab_size"])


def test_mixed_batch_equals_each_sequence_alone(case: tuple[PreTrainedModel, Path], decode_path: str) -> None:
    model, path = case
    runner = _runner(path)
    rng = random.Random(4)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    a, b, c = _tokens(17, seed=5), _tokens(9, seed=6), _tokens(14, seed=7)
    ta, tb, tc = (_table(len(s), rng, free) for s in (a, b, c))
    # b and c already have all but their last token in the pool; a has a cached prefix of 6 tokens
    runner.forward([BatchItem(b[:-1], 0, tb, False), BatchItem(c[:-1], 0, tc, False), BatchItem(a[:6], 0, ta, False)])
    mixed = runner.forward(
        [
            BatchItem([b[-1]], len(b) - 1, tb, True),
            BatchItem(a[6:], 6, ta, True),
            BatchItem([c[-1]], len(c) - 1, tc, True),
        ]
    )
    refs = [_hf_logits(model, s)[-1] for s in (b, a, c)]
    _close(mixed, torch.stack(refs))
    alone = [runner.forward([BatchItem([b[-1]], len(b) - 1, tb, True)])[0]]
    _close(mixed[0:1], torch.stack(alone))


def test_batched_decodes_of_different_lengths(case: tuple[PreTrainedModel, Path], decode_path: str) -> None:
    model, path = case
    runner = _runner(path)
    rng = random.Random(8)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs = [_tokens(n, seed=10 + n) for n in (5, 12, 8, 1)]
    tables = [_table(len(s) + 4, rng, free) for s in seqs]
    prefill = [BatchItem(s[:-1], 0, t, False) for s, t in zip(seqs, tables, strict=True) if len(s) > 1]
    runner.forward(prefill)
    out = runner.forward([BatchItem([s[-1]], len(s) - 1, t, True) for s, t in zip(seqs, tables, strict=True)])
    _close(out, torch.stack([_hf_logits(model, s)[-1] for s in seqs]))


def test_config_parsing_matches_hf(case: tuple[PreTrainedModel, Path]) -> None:
    model, path = case
    runner = _runner(path)
    config: PretrainedConfig = model.config
    assert runner.vocab_size == config.vocab_size
    assert runner.spec.num_kv_heads == config.num_key_value_heads
    assert runner.max_model_len == config.max_position_embeddings
