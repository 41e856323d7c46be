"""bench/reply_repetition.py end to end on the tiny model, and its repetition and overlap measures exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import reply_repetition


def test_candidates_are_scored_on_held_out_turns(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "rr.json"
    argv = ["--model", str(tiny_model_dir), "--turns", "3", "--max-tokens", "6", "--policy-chars", "200"]
    argv += ["--candidates", "greedy", "greedy, repetition 1.2", "--out", str(out)]
    assert reply_repetition.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["turns"] == 3
    assert set(result["results"]) == {"greedy", "greedy, repetition 1.2"}
    for scored in result["results"].values():
        assert scored["replies"] == 3
        assert 0.0 <= scored["repetition_rate"] <= 1.0
        assert 0.0 <= scored["handbook_quote_rate"] <= 1.0
        assert scored["thrice_rate"] <= scored["repetition_rate"]


@pytest.mark.parametrize(
    ("text", "repeats"),
    [
        ("How do I get a refund? How do I get a refund?", True),
        ("I can help with that. Could you share your order number?", False),
        ("the the the the", False),  # one 4-gram, once
        ("the the the the the", True),
    ],
)
def test_a_repeated_word_4gram_is_a_loop(text: str, repeats: bool) -> None:
    assert reply_repetition.repeats_4gram(text) is repeats


def test_a_loop_that_goes_on_repeats_a_4gram_three_times() -> None:
    assert reply_repetition.repeats_4gram("the the the the the", 3) is False  # one 4-gram, twice
    assert reply_repetition.repeats_4gram("the the the the the the", 3) is True
    assert reply_repetition.repeats_4gram("I'm so sorry. I'm so sorry. I'm so sorry.", 3) is False  # 4-grams twice


def test_overlap_f1_counts_shared_words() -> None:
    assert reply_repetition.overlap_f1("refund the order", "the order was refunded") == pytest.approx(2 * 2 / (3 + 4))
    assert reply_repetition.overlap_f1("", "anything") == 0.0


@pytest.mark.parametrize(
    ("reply", "quotes"),
    [
        ("Please click the [Search FAQ] button.", True),  # "click the search faq"
        ("Please click the FAQ button.", False),
        ("", False),
    ],
)
def test_a_reply_quotes_the_handbook_when_it_shares_a_word_4gram(reply: str, quotes: bool) -> None:
    system = "# Agent handbook\n1. [Search FAQ] Click the [Search FAQ] button"
    assert reply_repetition.quotes_prompt(reply, system) is quotes
