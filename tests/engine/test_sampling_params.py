"""SamplingParams: the penalties, bias, logprobs and grammar fields are checked by name; n choices derive seeds."""

from __future__ import annotations

import pytest

from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import GrammarKind, RepetitionScope, SamplingParams, StructuredOutput

REFUSED = [
    ({"repetition_penalty": 0.0}, r"^repetition_penalty must be in \[0\.01, 100\], got 0\.0$"),
    ({"repetition_penalty": 5e-324}, r"^repetition_penalty must be in \[0\.01, 100\], got 5e-324$"),  # (overflows)
    ({"repetition_penalty": float("nan")}, r"^repetition_penalty must be in \[0\.01, 100\], got nan$"),
    (
        {"repetition_penalty_scope": "prompt"},
        r"^repetition_penalty_scope must be one of 'all', 'reply', got 'prompt'$",
    ),
    ({"presence_penalty": 2.5}, r"^presence_penalty must be in \[-2, 2\], got 2\.5$"),
    ({"frequency_penalty": -2.01}, r"^frequency_penalty must be in \[-2, 2\], got -2\.01$"),
    ({"min_p": 1.5}, r"^min_p must be in \[0, 1\], got 1\.5$"),
    ({"logprobs": 21}, r"^logprobs must be an integer in \[0, 20\] or None, got 21$"),
    ({"logprobs": True}, r"^logprobs must be an integer, got True$"),
    ({"logit_bias": ((3, 101.0),)}, r"^logit_bias values must be in \[-100, 100\], got 101\.0 for token 3$"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, r"^logit_bias token ids must be distinct integers >= 0, got 3$"),
    ({"logit_bias": ((-1, 1.0),)}, r"^logit_bias token ids must be distinct integers >= 0, got -1$"),
    ({"logit_bias": ((1, 2, 3),)}, r"^logit_bias must be \(token id, bias\) pairs$"),
    (
        {"structured": StructuredOutput(GrammarKind.JSON_OBJECT), "ignore_eos": True},
        r"^ignore_eos cannot be combined with structured output$",
    ),
    ({"structured": "json"}, r"^structured must be a StructuredOutput, got 'json'$"),
]


@pytest.mark.parametrize(("params", "message"), REFUSED, ids=[str(p) for p, _ in REFUSED])
def test_out_of_range_values_are_refused_by_name(params: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        SamplingParams(**params)  # type: ignore[arg-type]


def test_the_defaults_change_no_logit() -> None:
    params = SamplingParams()
    assert not params.changes_logits
    assert not params.has_penalties
    assert SamplingParams(presence_penalty=0.1).changes_logits
    assert SamplingParams(logit_bias=((1, 0.5),)).changes_logits
    assert SamplingParams(structured=StructuredOutput(GrammarKind.JSON_OBJECT)).changes_logits


def test_choices_seed_choice_i_with_seed_plus_i() -> None:
    params = SamplingParams(temperature=0.7, seed=2**64 - 2)
    assert [p.seed for p in params.choices(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert params.choices(3)[0] == params
    unseeded = SamplingParams(temperature=0.7)
    assert unseeded.choices(2) == [unseeded, unseeded]
    with pytest.raises(InvalidSamplingParamsError, match=r"^n must be an integer >= 1, got 0$"):
        params.choices(0)


def test_the_repetition_penalty_covers_the_prompt_unless_scoped_to_the_reply() -> None:
    assert SamplingParams().repetition_penalty_scope is RepetitionScope.ALL
    scoped = SamplingParams(repetition_penalty=1.2, repetition_penalty_scope=RepetitionScope.REPLY)
    assert scoped.has_penalties
    assert not SamplingParams(repetition_penalty_scope=RepetitionScope.REPLY).has_penalties  # (1.0 is off either way)
