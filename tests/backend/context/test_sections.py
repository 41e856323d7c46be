"""Choosing a topic's handbook sections (pure): the best section for the epoch's messages, kept unless another
clearly beats it, at most two, none for an empty handbook or a message that matches nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backend.context.handbook import Section
from backend.context.sections import ChoiceSettings, SectionIndex, choose

SECTIONS = [
    Section("Returns and refunds", "Return an item within 30 days for a refund. Damaged or broken items: refund."),
    Section("Shipping and delivery", "Standard shipping takes 3 to 5 days. Tracking number, late delivery, carrier."),
    Section("Account and password", "Reset a password with Forgot password. Change the e-mail of the account."),
]
LEXICAL = ChoiceSettings(bm25_weight=1.0)  # BM25 alone: no embedding model needed


def titles(index: SectionIndex, chosen: tuple[int, ...]) -> list[str]:
    return [index.sections[i].title for i in chosen]


def test_the_best_section_for_the_topic_is_chosen() -> None:
    index = SectionIndex(SECTIONS)
    assert titles(index, choose(index, ["I want a refund, the blender arrived broken"], LEXICAL)) == [
        "Returns and refunds"
    ]
    assert titles(index, choose(index, ["where is my parcel? the tracking number shows nothing"], LEXICAL)) == [
        "Shipping and delivery"
    ]


def test_the_choice_is_kept_unless_another_section_clearly_beats_it() -> None:
    index = SectionIndex(SECTIONS)
    messages = ["I want a refund for a broken blender", "It arrived with a cracked jug. Order 302-1234567.", "ok"]
    for n in range(1, len(messages) + 1):
        assert titles(index, choose(index, messages[:n], LEXICAL)) == ["Returns and refunds"]
    # A passing word does not move it; a topic that moves clearly does.
    moved = [*messages, "also how long does shipping take? the delivery carrier, tracking, shipping days"]
    assert titles(index, choose(index, [*moved[:3], "the delivery box was fine"], LEXICAL)) == ["Returns and refunds"]
    assert titles(index, choose(index, moved, ChoiceSettings(bm25_weight=1.0, switch_margin=0.1)))[0] == (
        "Shipping and delivery"
    )


def test_a_close_runner_up_is_the_second_section_and_never_more() -> None:
    index = SectionIndex(SECTIONS)
    both = choose(index, ["refund and shipping"], ChoiceSettings(bm25_weight=1.0, second_ratio=0.5))
    assert sorted(titles(index, both)) == ["Returns and refunds", "Shipping and delivery"]
    assert len(choose(index, ["refund shipping password"], ChoiceSettings(bm25_weight=1.0, second_ratio=0.0))) == 2


def test_nothing_is_chosen_without_a_handbook_or_a_match() -> None:
    assert choose(SectionIndex([]), ["refund please"], LEXICAL) == ()
    index = SectionIndex(SECTIONS)
    assert choose(index, ["hello there", "ok thanks"], LEXICAL) == ()
    assert index.scores("", 1.0).tolist() == [0.0, 0.0, 0.0]


class CountingEmbedder:
    """Unit vectors from letter counts (a real, deterministic embedder), recording every text it encodes."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.encoded += texts
        rows = np.array([[t.lower().count(c) + 0.01 for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], np.float32)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_an_epoch_is_ranked_from_its_messages_vectors_never_from_the_joined_text() -> None:
    embedder = CountingEmbedder()
    index = SectionIndex(SECTIONS, embedder)
    embedder.encoded.clear()
    messages = ["I want a refund for a broken blender", "It arrived with a cracked jug.", "where is my parcel?"]
    latest = ChoiceSettings(min_score=0.0, switch_margin=-1.0)  # (the latest query's best always wins)
    chosen = choose(index, messages, latest)
    assert embedder.encoded == messages  # one batch, the messages themselves (a cache serves them next turn)
    vectors = embedder.embed(messages)
    mean = vectors.mean(axis=0) / np.linalg.norm(vectors.mean(axis=0))
    weights = (latest.bm25_weight, latest.example_weight, latest.group_weight)
    assert chosen[0] == index.ranked("\n".join(messages), *weights, vector=mean)[0].index
    # one message: its own vector, exactly what ranking the message alone gives
    one = ChoiceSettings(min_score=0.0)
    best = index.ranked(messages[0], one.bm25_weight, one.example_weight, one.group_weight)[0].index
    assert choose(index, messages[:1], one)[0] == best
