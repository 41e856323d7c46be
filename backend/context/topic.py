"""Topic epochs and the semantic temperature of a session.

Each customer message gets an on-topic score ``s`` in [0, 1] from the session's scorer (``ShiftScorer``), then:

    first message of a session:      epoch 0, temperature = start_temperature (0.8), similarity None
    s < shift_threshold (a shift):   epoch + 1, temperature = shift_temperature (0.3), the epoch's memory restarts
    otherwise (on topic):            temperature = clamp(T + warm_rate * (s - T), start_temperature, 1.0)

So a topic is "hot" (≥ 0.8) from its second message on, and messages that are clearly on topic warm it further; the
message that opened a new topic sits at 0.3 until the next one confirms it. Agent turns are context, never scored.

The scorers (``backend/context/scorers.py``):

- ``clf-static`` (the default) and ``clf-minilm``: the topic-shift classifier (``shift_classifier.py``), whose score is
  the probability that the message continues the topic. It reads the message's meaning against the epoch (sentence
  vectors), the agent's last move, the message's shape and identifier evidence; it was trained and its threshold
  tuned on the tuning half of the CuCom data by ``python -m bench.topic_shift --train``;
- ``minilm`` and ``tfidf``: ``CosineScorer``, the cosine between the message and the epoch's last ``window`` messages,
  adjusted by identifier evidence (see ``CosineScorer``); kept for comparison: they find few seams that the
  identifiers miss (docs/benchmarks.md);
- ``none``: never shifts (one epoch per session).

``TUNED_SETTINGS`` holds each scorer's tuned values; the defaults below are the default scorer's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backend.context.blocks import BlockType
from backend.context.errors import InvalidSettingsError, UnknownBackendError
from backend.context.rules import RuleSet
from backend.context.similarity import SimilarityBackend

Identify = Callable[[str], frozenset[str]]

# An agent sentence that asks for an order/account number: the number the customer sends next is an answer.
_ASKS_FOR_IDENTIFIER = re.compile(
    r"(?i)\b(?:order|account|acct|ticket|tracking|reference|ref|case)\s*(?:id|no\b|number|#)[^.!?。！]*[?？]"
    r"|(?:provide|share|confirm|send|give|tell|verify|enter)[^.!?。！]{0,40}"
    r"\b(?:order|account|acct|ticket|tracking|reference|ref|case)\s*(?:id|no\b|number|#)"
    r"|(?:订单号|单号|账号)[^。！？]*[吗？]|(?:提供|告诉|发送|确认)[^。！？]{0,10}(?:订单号|单号|账号)"
)
_WORD = re.compile(r"[a-zA-Z]{3,}|[\u4e00-\u9fff]")
_FILLER = frozenset(
    (
        "the",
        "and",
        "you",
        "your",
        "for",
        "are",
        "was",
        "but",
        "not",
        "its",
        "it's",
        "this",
        "that",
        "with",
        "have",
        "has",
        "had",
        "can",
        "will",
        "just",
        "now",
        "yes",
        "yeah",
        "yep",
        "okay",
        "thanks",
        "thank",
        "thx",
        "thnx",
        "please",
        "pls",
        "bye",
        "sure",
        "fine",
        "great",
        "cool",
        "got",
        "what",
        "when",
        "how",
        "why",
        "who",
        "all",
        "any",
    )
)


DEFAULT_SCORER = "clf-static"
EPOCH_MEMORY = 12  # customer messages of an epoch the scorer sees: its opening and the latest ones


@dataclass(frozen=True, slots=True)
class TopicSettings:
    """Per-tenant thresholds: the design's temperatures, and the shift detection tuned by bench/topic_shift.py.

    ``window``, ``min_evidence_words`` and ``new_identifier_cap`` only matter to the cosine scorers.
    """

    shift_threshold: float = 0.78
    start_temperature: float = 0.8
    shift_temperature: float = 0.3
    warm_rate: float = 0.5
    window: int = 2
    min_evidence_words: int = 0
    new_identifier_cap: float = 0.0
    backend: str = DEFAULT_SCORER

    def __post_init__(self) -> None:
        for name in ("shift_threshold", "start_temperature", "shift_temperature", "warm_rate", "new_identifier_cap"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidSettingsError(f"{name} must be within [0, 1], got {value}")
        if self.window < 1 or self.min_evidence_words < 0:
            raise InvalidSettingsError(f"window must be ≥ 1 and min_evidence_words ≥ 0, got {self}")


DESIGN_SHIFT_THRESHOLD = 0.3  # the product design's value, reported next to the tuned one

# Tuned with `python -m bench.topic_shift --train` (the classifiers: the threshold is stored with the model too) and
# `--tune` (the cosine scorers), on the tuning half of cucom_ecommerce_dev.jsonl only.
TUNED_SETTINGS: dict[str, TopicSettings] = {
    "clf-static": TopicSettings(shift_threshold=0.78, backend="clf-static"),
    "clf-minilm": TopicSettings(shift_threshold=0.75, backend="clf-minilm"),
    "minilm": TopicSettings(shift_threshold=0.01, window=2, min_evidence_words=0, backend="minilm"),
    "tfidf": TopicSettings(shift_threshold=0.01, window=8, min_evidence_words=4, backend="tfidf"),
    "none": TopicSettings(backend="none"),
}


def tuned(backend: str) -> TopicSettings:
    """The tuned settings for the scorer ``backend``."""
    if backend not in TUNED_SETTINGS:
        raise UnknownBackendError(f"no tuned settings for topic scorer {backend!r}")
    return TUNED_SETTINGS[backend]


@dataclass(frozen=True, slots=True)
class TopicUpdate:
    """What one customer message did to the session's topic (a row of the temperature history)."""

    similarity: float | None  # the scorer's on-topic score (None for a session's first message)
    temperature: float
    shift: bool
    epoch: int


@dataclass(slots=True)
class TopicState:
    """A session's topic: its epoch and temperature, and what the scorers read about the epoch so far."""

    epoch: int = 0
    temperature: float | None = None  # None until the first customer message
    recent: list[str] = field(default_factory=list)  # the last ``window`` messages, customer and agent
    customer: list[str] = field(default_factory=list)  # its opening and latest customer messages (EPOCH_MEMORY)
    agent: str | None = None  # the epoch's last agent message
    identifiers: set[str] = field(default_factory=set)
    asked_for_identifier: bool = False  # the last agent message asked the customer for an order/account number

    def remember_customer(self, text: str, found: frozenset[str], window: int) -> None:
        self._remember(text, found, window)
        self.customer.append(text)
        if len(self.customer) > EPOCH_MEMORY:
            del self.customer[1]  # NOTE: the opening stays: it states what the topic is
        self.asked_for_identifier = False  # answered (or ignored): the next number is unasked again

    def remember_agent(self, text: str, found: frozenset[str], window: int) -> None:
        self._remember(text, found, window)
        self.agent = text
        self.asked_for_identifier = _ASKS_FOR_IDENTIFIER.search(text) is not None

    def start_epoch(self) -> None:
        self.epoch += 1
        self.recent.clear()
        self.customer.clear()
        self.agent = None
        self.identifiers.clear()

    def _remember(self, text: str, found: frozenset[str], window: int) -> None:
        self.recent.append(text)
        del self.recent[:-window]
        self.identifiers |= found


class ShiftScorer(Protocol):
    """How on topic a customer message is, in [0, 1]; the tracker shifts below ``shift_threshold``."""

    name: str

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float: ...


class CosineScorer:
    """A similarity backend's cosine with the epoch's last ``window`` messages, adjusted by the text's evidence:

    - a message with fewer than ``min_evidence_words`` content words ("ok thanks", "yes") never shifts: its cosine
      says little, and a chat is full of them;
    - a message naming an identifier (order, account, ticket number; not a phone or e-mail) the epoch already named
      is on topic (s = 1); naming only identifiers the epoch has not seen caps s at ``new_identifier_cap`` (a new
      order is a new problem), unless the last agent message asked for such a number (then it is the answer) or the
      epoch named none yet (the first order number of an issue numbers that issue: the backend decides).
    """

    def __init__(self, backend: SimilarityBackend) -> None:
        self.backend = backend
        self.name = backend.name

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float:
        cosine = self.backend.similarity(message, state.recent[-settings.window :])
        if found & state.identifiers:
            return 1.0
        if found and state.identifiers and not state.asked_for_identifier:
            return min(cosine, settings.new_identifier_cap)
        if evidence_words(message) < settings.min_evidence_words:
            return max(cosine, settings.shift_threshold)
        return cosine


class NoShift:
    """Every message is on topic: one epoch per session."""

    name = "none"

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float:
        return 1.0


class TopicTracker:
    """Updates one session's ``TopicState`` message by message (the caller persists what it returns)."""

    def __init__(
        self,
        settings: TopicSettings,
        scorer: ShiftScorer,
        identify: Identify = lambda _text: frozenset(),
        state: TopicState | None = None,
    ) -> None:
        self.settings = settings
        self.scorer = scorer
        self.identify = identify
        self.state = state or TopicState()

    def observe_context(self, text: str) -> None:
        """An agent (or bot) message: the epoch remembers it, but it is not scored."""
        self.state.remember_agent(text, self.identify(text), self.settings.window)

    def observe_customer(self, text: str) -> TopicUpdate:
        """Score a customer message against the epoch, update epoch and temperature, and return the history row."""
        s, st = self.settings, self.state
        found = self.identify(text)
        if st.temperature is None or not st.customer:
            # NOTE: nothing to compare with (a session's first message, or a state rebuilt without its epoch)
            temperature = s.start_temperature if st.temperature is None else st.temperature
            st.temperature = temperature
            st.remember_customer(text, found, s.window)
            return TopicUpdate(None, temperature, False, st.epoch)
        similarity = self.scorer.on_topic(text, found, st, s)
        shift = similarity < s.shift_threshold
        if shift:
            st.start_epoch()
            st.temperature = s.shift_temperature
        else:
            warmed = st.temperature + s.warm_rate * (similarity - st.temperature)
            st.temperature = min(1.0, max(s.start_temperature, warmed))
        st.remember_customer(text, found, s.window)
        return TopicUpdate(similarity, st.temperature, shift, st.epoch)


def evidence_words(text: str) -> int:
    """Content words in ``text``: words of 3+ letters that are not chat filler (each CJK character counts)."""
    return sum(1 for w in _WORD.findall(text) if w.lower() not in _FILLER)


CONTACT_RULES = frozenset({"phone", "email"})


def identifier_keys(rules: RuleSet, min_digits: int = 6, skip: frozenset[str] = CONTACT_RULES) -> Identify:
    """Identify a message's topic keys: the digits of each identifier match that has at least ``min_digits``.

    NOTE: contact details (the rules in ``skip``) are not topic keys: a customer gives the same phone number for
    every problem, and gives it in the middle of one, so a "new" phone number says nothing about the topic.

    NOTE: digits only, so "order number 406-8765432-9876543" and "#406-8765432-9876543" are one key; matches without
    enough digits are dropped: redacted e-mails ("[email protected]") are the same string in every conversation and
    would glue unrelated topics together.
    """

    def identify(text: str) -> frozenset[str]:
        keys = (re.sub(r"\D", "", m) for m in rules.find_all(text, BlockType.IDENTIFIER, skip))
        return frozenset(k for k in keys if len(k) >= min_digits)

    return identify
