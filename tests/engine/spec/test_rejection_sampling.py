"""Speculative rejection sampling keeps the model's distribution: chi-square tests on a 6-token vocabulary.

The draws are seeded, so each test gives the same counts every run (it cannot flake); the threshold is the
chi-square 0.1 % point for 5 degrees of freedom, which a wrong acceptance rule (accepting every draft, or drawing
the rejection's token from the whole distribution) exceeds by far: checked below against a wrong rule.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

CHI2_5DF_0_001 = 20.52
TRIALS = 6000
LOGITS = torch.tensor(
    [[1.5, 0.2, -0.3, 0.9, -1.0, 0.4], [0.1, 1.2, 0.8, -0.5, 0.3, -1.2], [0.0, 0.5, 1.0, 1.5, 2.0, 0.0]]
)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs))


def emitted(drafts: list[int], temperature: float = 1.0, trials: int = TRIALS) -> list[list[int]]:
    sampler = Sampler("cpu", seed=0)
    state = sampler.new_state(SamplingParams(max_tokens=8, temperature=temperature), ())
    rows = LOGITS[: len(drafts) + 1]
    out = []
    for _ in range(trials):
        tokens = sampler.verify(rows, state, drafts)
        assert isinstance(tokens, list)
        out.append(tokens)
    return out


@pytest.mark.parametrize("draft", [0, 4], ids=["likely draft", "unlikely draft"])
def test_the_first_token_follows_the_model(draft: int) -> None:
    first = Counter(tokens[0] for tokens in emitted([draft]))
    assert chi_square(first, torch.softmax(LOGITS[0], -1)) < CHI2_5DF_0_001


def test_the_next_token_follows_the_model_after_an_accepted_draft() -> None:
    runs = emitted([0, 1], temperature=0.8)
    second = Counter(tokens[1] for tokens in runs if tokens[0] == 0)
    assert sum(second.values()) > 2000
    assert chi_square(second, torch.softmax(LOGITS[1] / 0.8, -1)) < CHI2_5DF_0_001
    assert all(len(t) == 3 for t in runs if t[:2] == [0, 1])  # both drafts taken: one more token after them


def test_the_threshold_catches_a_wrong_rule() -> None:
    accept_all = Counter({0: TRIALS})  # e.g. a rule that accepted every draft
    assert chi_square(accept_all, torch.softmax(LOGITS[0], -1)) > CHI2_5DF_0_001


def test_a_seeded_request_draws_the_same_tokens() -> None:
    def run() -> list[list[int]]:
        sampler = Sampler("cpu")  # (the shared generator is unseeded: the request's seed alone decides)
        state = sampler.new_state(SamplingParams(max_tokens=8, temperature=1.0, seed=3), ())
        return [sampler.verify(LOGITS, state, [0, 1]) for _ in range(50)]  # type: ignore[misc]

    assert run() == run()


def test_greedy_takes_drafts_up_to_the_first_mismatch() -> None:
    sampler = Sampler("cpu")
    state = sampler.new_state(SamplingParams(max_tokens=8), ())
    assert sampler.verify(LOGITS, state, [0, 1]) == [0, 1, 4]
    assert sampler.verify(LOGITS, state, [0, 2]) == [0, 1]
    assert sampler.verify(LOGITS, state, [3, 1]) == [0]
    assert state.num_generated == 6
