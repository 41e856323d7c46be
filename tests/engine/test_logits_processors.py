"""Logits processors: each equals vLLM's dense formula exactly, touches only its own row, and keeps masks masked."""

from __future__ import annotations

import pytest
import torch

from engine.logits_processors import (
    TokenHistory,
    apply_logit_bias,
    apply_penalties,
    logit_bias_tensors,
    mask_ids,
    min_p,
)
from engine.sampling_params import RepetitionScope, SamplingParams

VOCAB = 50


def dense_reference(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's ``apply_penalties`` over the whole vocabulary (vllm/model_executor/layers/utils.py); with
    ``RepetitionScope.REPLY`` its prompt mask is left empty (the repetition penalty on the reply's tokens only)."""
    logits = row.clone()
    prompt_mask = torch.zeros(VOCAB, dtype=torch.bool)
    if p.repetition_penalty_scope is RepetitionScope.ALL:
        prompt_mask[prompt] = True
    counts = torch.zeros(VOCAB)
    for t in output:
        counts[t] += 1
    output_mask = counts > 0
    penalties = torch.where(prompt_mask | output_mask, p.repetition_penalty, 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= p.frequency_penalty * counts
    logits -= p.presence_penalty * output_mask
    return logits


@pytest.mark.parametrize("scope", list(RepetitionScope))
@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.5), (1.2, 0.5, 0.4), (0.8, -0.6, -1.0)],
)
def test_penalties_equal_vllms_dense_formula_exactly(
    repetition: float, frequency: float, presence: float, scope: RepetitionScope
) -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = [3, 3, 9, 17, 42, 9]
    output = [5, 9, 5, 5, 44, 3]
    params = SamplingParams(
        max_tokens=8,
        repetition_penalty=repetition,
        repetition_penalty_scope=scope,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    history = TokenHistory(prompt, params.max_tokens)
    for t in output:
        history.record(t)
    row = torch.randn(VOCAB, generator=gen) * 4
    got = row.clone()
    apply_penalties(got, history, params)
    assert torch.equal(got, dense_reference(row, prompt, output, params))


def test_a_reply_scoped_repetition_penalty_leaves_prompt_only_tokens_alone() -> None:
    """Prompt ids 3 and 9, reply ids 9 and 5: with the reply scope only 9 and 5 are penalised (9 once, though seen in
    both), and the prompt's 3 keeps its logit; with the default scope all three are."""
    history = TokenHistory([3, 9, 3], max_tokens=4)
    for t in (9, 5, 9):
        history.record(t)
    row = torch.zeros(VOCAB)
    row[3], row[5], row[9], row[11] = 2.0, -1.0, 4.0, 3.0
    reply, every = row.clone(), row.clone()
    scoped = SamplingParams(repetition_penalty=2.0, repetition_penalty_scope=RepetitionScope.REPLY)
    apply_penalties(reply, history, scoped)
    apply_penalties(every, history, SamplingParams(repetition_penalty=2.0))
    assert [reply[t].item() for t in (3, 5, 9, 11)] == [2.0, -2.0, 2.0, 3.0]
    assert [every[t].item() for t in (3, 5, 9, 11)] == [1.0, -2.0, 2.0, 3.0]


def test_history_keeps_distinct_seen_ids_and_reply_counts() -> None:
    history = TokenHistory([7, 7, 2], max_tokens=5)
    for t in (4, 7, 4, 4, 1):
        history.record(t)
    assert history.seen_ids.tolist() == [7, 2, 4, 1]
    assert history.output_ids.tolist() == [4, 7, 1]
    assert history.output_counts.tolist() == [3.0, 1.0, 1.0]


def test_penalties_keep_masked_tokens_masked() -> None:
    params = SamplingParams(max_tokens=4, repetition_penalty=1.5, frequency_penalty=-2.0, presence_penalty=-2.0)
    history = TokenHistory([1, 2], params.max_tokens)
    history.record(2)
    row = torch.zeros(VOCAB)
    row[1], row[2] = float("-inf"), float("-inf")
    apply_penalties(row, history, params)
    assert row[1].item() == float("-inf")
    assert row[2].item() == float("-inf")


def test_logit_bias_adds_to_the_named_ids_only() -> None:
    row = torch.arange(VOCAB, dtype=torch.float32)
    ids, values = logit_bias_tensors(((3, 100.0), (49, -100.0)), torch.device("cpu"))
    apply_logit_bias(row, ids, values)
    expected = torch.arange(VOCAB, dtype=torch.float32)
    expected[3], expected[49] = 103.0, -51.0
    assert torch.equal(row, expected)


def test_mask_ids_refuses_to_mask_every_token() -> None:
    row = torch.zeros(4)
    assert not mask_ids(row, [0, 1, 2, 3, 99])
    assert torch.equal(row, torch.zeros(4))
    assert mask_ids(row, [0, 2, 99])
    assert row.tolist() == [float("-inf"), 0.0, float("-inf"), 0.0]


def test_min_p_drops_tokens_below_p_times_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    kept = min_p(probs.log(), 0.2)  # 0.2 * 0.5 = 0.1: 0.08 goes, 0.12 stays
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    assert torch.equal(min_p(probs.log(), 0.0), probs.log())
