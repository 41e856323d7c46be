"""The classifier's features of one message against an epoch, each checked on a hand-built state."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from backend.context.minilm import Array
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.shift_features import FEATURES, meaning_text, shift_features
from backend.context.topic import TopicState, identifier_keys

IDENT = identifier_keys(RuleSet.compile(DEFAULT_RULES))


class AxisEmbedder:
    """Each known text is a fixed unit vector in 3-D, so every cosine is known exactly (asked for by its
    ``meaning_text``: the features embed texts without their numbers)."""

    name = "axes"

    def __init__(self, vectors: dict[str, Sequence[float]]) -> None:
        self.vectors = {t: np.asarray(v, dtype=np.float32) / np.linalg.norm(v) for t, v in vectors.items()}
        self.asked: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> Array:
        self.asked.append(list(texts))
        by_meaning = {meaning_text(t): v for t, v in self.vectors.items()}
        return np.stack([by_meaning[t] for t in texts])


OPENING = "My parcel from order #617-8899001-1122334 never arrived."
FOLLOW = "it was due on monday"
AGENT = "Sorry about that. Could you please share your delivery address?"


def _state() -> TopicState:
    state = TopicState()
    state.remember_customer(OPENING, IDENT(OPENING), window=2)
    state.remember_customer(FOLLOW, IDENT(FOLLOW), window=2)
    state.remember_agent(AGENT, IDENT(AGENT), window=2)
    return state


def values(message: str, state: TopicState, embedder: AxisEmbedder) -> dict[str, float]:
    f = shift_features(message, IDENT(message), state, embedder)
    return dict(zip(FEATURES, f.values.tolist(), strict=True))


def test_shape_agent_and_identifier_features() -> None:
    message = "also, order #406-8765432-9876543 was charged twice?"
    embedder = AxisEmbedder({OPENING: [1, 0, 0], FOLLOW: [1, 0, 0], AGENT: [0, 1, 0], message: [0, 0, 1]})
    got = values(message, _state(), embedder)
    # the sentence vectors read the texts without their numbers: the identifier features read those
    assert embedder.asked == [["also, order was charged twice?", "My parcel from order never arrived.", FOLLOW, AGENT]]
    assert got["words"] == pytest.approx(np.log1p(5))  # also, order, was, charged, twice (the number is no word)
    assert (got["question"], got["cue"], got["thanks"], got["anaphora"]) == (1.0, 1.0, 0.0, 0.0)
    assert (got["agent_asks"], got["agent_question"], got["agent_offers"]) == (1.0, 1.0, 0.0)
    # the agent asked for an address, not a number: the new order number counts as unasked
    assert (got["known_identifier"], got["new_identifier"], got["asked_identifier"]) == (0.0, 1.0, 0.0)
    assert got["first_identifier"] == 0.0  # the epoch named an order already: this one is a second order
    assert [got[k] for k in ("cos_epoch", "cos_opening", "cos_max", "cos_last", "cos_agent")] == [0, 0, 0, 0, 0]


def test_cosines_to_the_epoch_its_opening_nearest_latest_and_the_agent() -> None:
    message = "ok thanks, it came"
    embedder = AxisEmbedder({OPENING: [1, 0, 0], FOLLOW: [0, 1, 0], AGENT: [1, 1, 0], message: [0, 1, 0]})
    got = values(message, _state(), embedder)
    assert got["cos_epoch"] == pytest.approx(np.sqrt(0.5))  # the centroid (0.5, 0.5, 0) against (0, 1, 0)
    assert (got["cos_opening"], got["cos_max"], got["cos_last"]) == (0.0, 1.0, 1.0)
    assert got["cos_agent"] == pytest.approx(np.sqrt(0.5))
    assert (got["thanks"], got["question"], got["cue"]) == (1.0, 0.0, 0.0)
    assert got["anaphora"] == pytest.approx(2 / 4)  # "ok", "it" of 4 words


def test_a_known_number_and_an_asked_for_number() -> None:
    state = _state()
    embedder = AxisEmbedder({OPENING: [1, 0, 0], FOLLOW: [1, 0, 0], AGENT: [0, 1, 0]})
    known = "any news on 617-8899001-1122334"
    embedder.vectors[known] = np.asarray([1, 0, 0], dtype=np.float32)
    assert values(known, state, embedder)["known_identifier"] == 1.0
    asked = "What is your order number?"
    state.remember_agent(asked, frozenset(), window=2)
    answer = "its 406-8765432-9876543"
    embedder.vectors |= {asked: np.asarray([0, 1, 0], np.float32), answer: np.asarray([0, 0, 1], np.float32)}
    got = values(answer, state, embedder)
    assert (got["new_identifier"], got["asked_identifier"], got["agent_asks"]) == (0.0, 1.0, 1.0)


def test_the_first_identifier_of_an_epoch_is_not_a_new_one() -> None:
    opening = "I want a refund for the blender I bought last week."
    message = "It arrived with a cracked jug. Order 302-1234567."
    state = TopicState()
    state.remember_customer(opening, IDENT(opening), window=2)
    embedder = AxisEmbedder({opening: [1, 0, 0], message: [1, 1, 0]})
    got = values(message, state, embedder)
    assert IDENT(message) == frozenset({"3021234567"})
    assert (got["known_identifier"], got["first_identifier"], got["new_identifier"]) == (0.0, 1.0, 0.0)
    state.remember_customer(message, IDENT(message), window=2)
    second = "Order 406-8765432-9876543 was charged twice."
    embedder.vectors[second] = np.asarray([0, 0, 1], np.float32)
    got = values(second, state, embedder)
    assert (got["known_identifier"], got["first_identifier"], got["new_identifier"]) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    ("message", "gives"),
    [
        ("My email is priya.sharma34@gmail.com.", True),  # a contact detail: no topic key, still an identifier
        ("my tracking number says 9400250235828599617786", True),
        ("My order number is 302-1234567", True),  # "is" between: the order rule takes no key from it
        ("it cost 1,299 and came in 2 boxes", False),
        ("the WH-1000XM4 headphones", False),  # a model name: 5 digits
    ],
)
def test_an_identifier_by_its_shape_is_a_first_identifier(message: str, gives: bool) -> None:
    opening = "I want a refund for the blender I bought last week."
    state = TopicState()
    state.remember_customer(opening, IDENT(opening), window=2)
    embedder = AxisEmbedder({opening: [1, 0, 0], message: [1, 1, 0]})
    got = values(message, state, embedder)
    assert (got["first_identifier"], got["new_identifier"]) == (float(gives), 0.0)


def test_an_asked_for_first_identifier_is_an_answer() -> None:
    opening = "my parcel never arrived"
    asked = "Could you please share your order number?"
    answer = "its 406-8765432-9876543"
    state = TopicState()
    state.remember_customer(opening, IDENT(opening), window=2)
    state.remember_agent(asked, IDENT(asked), window=2)
    embedder = AxisEmbedder({opening: [1, 0, 0], asked: [0, 1, 0], answer: [0, 0, 1]})
    got = values(answer, state, embedder)
    assert (got["first_identifier"], got["new_identifier"], got["asked_identifier"]) == (0.0, 0.0, 1.0)


def test_meaning_text_drops_numbers_e_mail_addresses_and_sentences_that_only_gave_them() -> None:
    assert meaning_text("It arrived with a cracked jug. Order 302-1234567.") == "It arrived with a cracked jug."
    assert meaning_text("My email is mei.lin@icloud.com. Is it?") == "Is it?"  # no identifier: a sentence stays
    assert meaning_text("Order #617-8899001-1122334 marked delivered") == "Order marked delivered"
    assert meaning_text("write to mei.lin@icloud.com or  call +91 98765 43210 now") == "write to or call now"
    assert meaning_text("ok thanks") == "ok thanks"


def test_chinese_cues_questions_and_thanks() -> None:
    embedder = AxisEmbedder({OPENING: [1, 0, 0], FOLLOW: [1, 0, 0], AGENT: [0, 1, 0]})
    for text, feature in (("另外，我的优惠券不能用", "cue"), ("能退货吗", "question"), ("谢谢", "thanks")):
        embedder.vectors[text] = np.asarray([0, 0, 1], np.float32)
        assert values(text, _state(), embedder)[feature] == 1.0
