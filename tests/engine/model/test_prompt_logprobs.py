"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) against a full transformers forward, fp32 tiny model.

The request's prefill is chunked at positions not aligned to blocks, and the same prompt is cached beforehand: the
request must compute every position itself (no prefix hit), and its reply must not change.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import SamplingParams
from support.engines import make_engine, one_intra_op_thread

TOL = 1e-4


def test_prompt_logprobs_equal_log_softmax_of_a_full_hf_forward(tiny_model_dir: Path) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 384) for _ in range(70)]
    with one_intra_op_thread():
        engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
        plain = engine.generate_sync([prompt], SamplingParams(max_tokens=3))[0]
        scored = engine.generate_sync([prompt], SamplingParams(max_tokens=3, prompt_logprobs=True))[0]
        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]

    assert scored.stats.cached_tokens == 0  # 64 tokens of it were cached: a cached block has no logits
    assert scored.token_ids == plain.token_ids
    assert plain.prompt_logprobs is None
    assert scored.prompt_logprobs is not None
    assert len(scored.prompt_logprobs) == len(prompt)
    assert scored.prompt_logprobs[0] is None
    values = torch.tensor([v for v in scored.prompt_logprobs[1:] if v is not None])
    assert values.shape == reference.shape
    assert (values - reference).abs().max().item() <= TOL


def test_prompt_logprobs_must_be_a_boolean() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs must be a boolean"):
        SamplingParams(prompt_logprobs=1)  # type: ignore[arg-type]
