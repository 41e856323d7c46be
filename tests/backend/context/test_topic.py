"""Topic epochs and semantic temperature: the update rule exactly, evidence adjustments, settings validation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backend.context.errors import InvalidSettingsError, UnknownBackendError
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.topic import (
    CosineScorer,
    NoShift,
    TopicSettings,
    TopicTracker,
    TopicUpdate,
    evidence_words,
    identifier_keys,
    tuned,
)

IDENT = identifier_keys(RuleSet.compile(DEFAULT_RULES))


class ScriptedSimilarity:
    """Answers the similarities a test scripts, in order, and records what it was asked."""

    name = "scripted"

    def __init__(self, answers: Sequence[float]) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, list[str]]] = []

    def similarity(self, message: str, context: Sequence[str]) -> float:
        self.asked.append((message, list(context)))
        return self.answers.pop(0)


SETTINGS = TopicSettings(shift_threshold=0.3, window=3, min_evidence_words=0)


def test_first_message_starts_epoch_zero_hot_without_a_similarity() -> None:
    tracker = TopicTracker(SETTINGS, CosineScorer(ScriptedSimilarity([])))
    assert tracker.observe_customer("my parcel never arrived") == TopicUpdate(None, 0.8, False, 0)


def test_the_temperature_update_rule_step_by_step() -> None:
    backend = ScriptedSimilarity([0.9, 0.95, 0.5, 0.1, 0.6, 0.9])
    tracker = TopicTracker(SETTINGS, CosineScorer(backend))
    updates = [tracker.observe_customer(f"message {i}") for i in range(7)]
    assert [(u.similarity, round(u.temperature, 9), u.shift, u.epoch) for u in updates] == [
        (None, 0.8, False, 0),
        (0.9, 0.85, False, 0),  # 0.8 + 0.5 * (0.9 - 0.8)
        (0.95, 0.9, False, 0),  # 0.85 + 0.5 * (0.95 - 0.85)
        (0.5, 0.8, False, 0),  # 0.9 + 0.5 * (0.5 - 0.9) = 0.7, floored at 0.8
        (0.1, 0.3, True, 1),  # below 0.3: a shift
        (0.6, 0.8, False, 1),  # 0.3 + 0.5 * (0.6 - 0.3) = 0.45, a confirmed topic: 0.8
        (0.9, 0.85, False, 1),
    ]


def test_the_window_holds_the_epochs_recent_messages_agent_turns_included_and_restarts_on_a_shift() -> None:
    backend = ScriptedSimilarity([0.9, 0.9, 0.05, 0.9])
    tracker = TopicTracker(SETTINGS, CosineScorer(backend))
    tracker.observe_customer("c1")
    tracker.observe_context("a1")
    tracker.observe_customer("c2")
    tracker.observe_context("a2")
    tracker.observe_customer("c3")
    tracker.observe_customer("c4")  # the shift
    tracker.observe_customer("c5")
    assert backend.asked == [
        ("c2", ["c1", "a1"]),
        ("c3", ["a1", "c2", "a2"]),  # window 3
        ("c4", ["c2", "a2", "c3"]),
        ("c5", ["c4"]),  # the new epoch's messages only
    ]


def test_a_message_with_little_evidence_never_shifts() -> None:
    settings = TopicSettings(shift_threshold=0.3, min_evidence_words=3)
    tracker = TopicTracker(settings, CosineScorer(ScriptedSimilarity([0.0, 0.0])))
    tracker.observe_customer("my blender arrived broken yesterday")
    assert evidence_words("ok thanks, bye!") == 0
    assert tracker.observe_customer("ok thanks, bye!") == TopicUpdate(0.3, 0.8, False, 0)
    assert tracker.observe_customer("also the toaster sparks badly") == TopicUpdate(0.0, 0.3, True, 1)


def test_identifiers_the_epoch_named_keep_the_topic_and_new_ones_cap_it() -> None:
    settings = TopicSettings(shift_threshold=0.3, min_evidence_words=0, new_identifier_cap=0.1)
    tracker = TopicTracker(settings, CosineScorer(ScriptedSimilarity([0.05, 0.9, 0.9])), IDENT)
    tracker.observe_customer("Order #617-8899001-1122334 marked delivered but never got it")
    same = tracker.observe_customer("did you check 617-8899001-1122334 yet")
    assert (same.similarity, same.shift) == (1.0, False)  # the backend said 0.05; the order number says on topic
    other = tracker.observe_customer("and order #406-8765432-9876543 is missing too")
    assert (other.similarity, other.shift, other.epoch) == (0.1, True, 1)  # capped at 0.1 < 0.3
    unrelated = tracker.observe_customer("the new one is fine, thanks a lot for the quick help")
    assert (unrelated.similarity, unrelated.shift) == (0.9, False)  # no identifier: the backend decides


def test_the_first_identifier_of_an_epoch_is_not_capped_but_a_second_one_is() -> None:
    settings = TopicSettings(shift_threshold=0.3, min_evidence_words=0, new_identifier_cap=0.1)
    tracker = TopicTracker(settings, CosineScorer(ScriptedSimilarity([0.6, 0.6])), IDENT)
    tracker.observe_customer("I want a refund for the blender I bought last week.")
    first = tracker.observe_customer("It arrived with a cracked jug. Order 302-1234567.")
    assert (first.similarity, first.shift, first.epoch) == (0.6, False, 0)  # the backend decides, uncapped
    assert tracker.state.identifiers == {"3021234567"}
    second = tracker.observe_customer("Order 406-8765432-9876543 was charged twice.")
    assert (second.similarity, second.shift, second.epoch) == (0.1, True, 1)  # a second order: capped


def test_a_new_number_answering_the_agents_question_is_no_shift() -> None:
    settings = TopicSettings(shift_threshold=0.3, min_evidence_words=0, new_identifier_cap=0.1)
    tracker = TopicTracker(settings, CosineScorer(ScriptedSimilarity([0.5, 0.5, 0.5])), IDENT)
    tracker.observe_customer("my parcel never arrived and the tracking page is blank")
    tracker.observe_context("Sorry about that. Could you please share your order number?")
    answer = tracker.observe_customer("sure, its 406-8765432-9876543")
    assert (answer.similarity, answer.shift) == (0.5, False)  # asked for: an answer, not a new problem
    tracker.observe_context("Thank you, I have raised a complaint with the courier. Anything else?")
    other = tracker.observe_customer("Yes, order #617-8899001-1122334 was charged twice")
    assert (other.similarity, other.shift, other.epoch) == (0.1, True, 1)  # unasked: a new problem
    tracker.observe_context("请提供您的订单号。")
    assert tracker.state.asked_for_identifier


def test_identifier_keys_are_digits_of_long_numbers_only() -> None:
    assert IDENT("order number 406-8765432-9876543 and #406-8765432-9876543") == frozenset({"40687654329876543"})
    assert IDENT("ref number LP567890123456") == frozenset({"567890123456"})
    assert IDENT("mail [email protected], phone 9876543210") == frozenset()  # contact details are no topic keys
    assert IDENT("the WH-1000XM4 costs 1,299") == frozenset()


@pytest.mark.parametrize(
    ("field", "value"),
    [("shift_threshold", 1.5), ("start_temperature", -0.1), ("warm_rate", 2.0), ("window", 0)],
)
def test_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidSettingsError) as refused:
        TopicSettings(**{field: value})  # type: ignore[arg-type]
    assert refused.value.code == "invalid_settings"
    assert field in str(refused.value)


def test_defaults_are_the_default_scorers_tuned_settings() -> None:
    assert tuned("clf-static") == TopicSettings()
    assert tuned("tfidf").backend == "tfidf"
    with pytest.raises(UnknownBackendError) as refused:
        tuned("word2vec")
    assert str(refused.value) == "no tuned settings for topic scorer 'word2vec'"


def test_the_none_scorer_keeps_one_epoch() -> None:
    tracker = TopicTracker(tuned("none"), NoShift(), IDENT)
    tracker.observe_customer("Order #617-8899001-1122334 marked delivered but never got it")
    other = tracker.observe_customer("and order #406-8765432-9876543 is missing too")
    assert other == TopicUpdate(1.0, 0.9, False, 0)


def test_the_agents_question_covers_only_the_next_customer_message() -> None:
    settings = TopicSettings(shift_threshold=0.3, min_evidence_words=0, new_identifier_cap=0.1)
    tracker = TopicTracker(settings, CosineScorer(ScriptedSimilarity([0.5, 0.5, 0.5])), IDENT)
    tracker.observe_customer("my parcel never arrived and the tracking page is blank")
    tracker.observe_context("What is the order number?")
    assert not tracker.observe_customer("its 406-8765432-9876543").shift
    assert tracker.observe_customer("and order #617-8899001-1122334 is another problem").shift
