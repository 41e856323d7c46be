"""What the topic-shift classifier reads about one customer message: its shape, the agent's last move, identifier
evidence, and how close its meaning is to the current topic.

Every feature is computed from the message and the ``TopicState`` the tracker holds (the epoch's customer messages,
its last agent message, the identifiers it named), so training (``bench/topic_shift.py --train``) and serving read
the same values. ``FEATURES`` names them in order; the classifier adds one more of its own, ``opening_like``.

- shape: ``words`` (log of the word count), ``question``, ``anaphora`` (share of words that lean on what was said:
  "it", "that", "so", "ok", "它", "这个"), ``thanks`` (a short thanks or bye), ``cue`` (opens with "also", "one more
  thing", "another issue", "另外", "还有");
- the agent's last message: ``agent_asks`` (ends with a question: the customer is likely answering it),
  ``agent_question`` (asks anything), ``agent_offers`` ("anything else I can help with?": an invitation to a new
  issue);
- identifiers (order, account, ticket numbers; ``topic.identifier_keys``): ``known_identifier`` (one the epoch
  named), ``first_identifier`` (the message gives an identifier, a key or anything shaped like one: an e-mail
  address, a token with 6+ digits, while the epoch named no key yet: "It arrived with a cracked jug. Order
  302-1234567." is the same issue, numbered), ``new_identifier`` (the epoch named others and this one is
  different: a second order is likely a second problem), both only when the agent did not ask for one, and
  ``asked_identifier``;
- meaning (cosines of sentence vectors): to the centroid of the epoch's customer messages, its opening message, the
  nearest and the latest of them, and the agent's last message. The vectors are of ``meaning_text``: the texts
  without their numbers and e-mail addresses, which the identifier features read instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from backend.context.minilm import Array

if TYPE_CHECKING:
    from backend.context.topic import TopicState


class Embedder(Protocol):
    """Unit sentence vectors, one row per text (``StaticEmbedder``, ``MiniLMSimilarity``)."""

    name: str

    def embed(self, texts: Sequence[str]) -> Array: ...


FEATURES: tuple[str, ...] = (
    "words",
    "question",
    "anaphora",
    "thanks",
    "cue",
    "agent_asks",
    "agent_question",
    "agent_offers",
    "known_identifier",
    "first_identifier",
    "new_identifier",
    "asked_identifier",
    "cos_epoch",
    "cos_opening",
    "cos_max",
    "cos_last",
    "cos_agent",
)

_WORD = re.compile(r"[A-Za-z']+|[\u4e00-\u9fff]")
_QUESTION = re.compile(r"[?？]|[吗呢嘛]\s*[。.!！]?\s*$")
_ANAPHORA = re.compile(
    r"(?i)\b(?:it|its|it's|that|this|they|them|those|these|same|there|then|so|yes|yeah|no|nope|ok|okay|fine|sure"
    r"|done|still)\b|它|这个|那个|好的|是的|行|嗯"
)
_THANKS = re.compile(r"(?i)\b(?:thanks|thank\s+you|thx|thnx|ty|bye|goodbye)\b|谢谢|再见|拜拜")
_CUE = re.compile(
    r"(?i)^\W*(?:also|and\s+also|another\s+(?:thing|question|issue|problem)|one\s+more\s+(?:thing|question)"
    r"|btw|by\s+the\s+way|apart\s+from\s+(?:this|that)|separately|unrelated)\b|^\W*(?:另外|还有|再问|顺便)"
)
_AGENT_OFFERS = re.compile(
    r"(?i)anything\s+else|any\s+other\s+(?:question|issue|concern)|further\s+(?:question|assist|help)"
    r"|else\s+i\s+can\s+(?:help|assist)|还有什么|其他问题"
)
_SHORT_THANKS_WORDS = 8
# NOTE: by shape, wider than the key rules: "my order number is 302-1234567", a tracking number or an e-mail address
# gives no topic key (``identifier_keys``), yet puts the same weight on the message's sentence vector
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\[email\s+protected\]")
_ID_TOKEN = re.compile(r"(?<![\w-])#?[A-Za-z]{0,4}-?\d[\dA-Za-z-]{4,}(?![\w-])")
_ID_DIGITS = 6
# NOTE: a number is many word pieces ("302-1234567": 302, -, 123, ##45, ##67), and the data's openings are full of
# them, so a follow-up that gave its order number read like an opening (issue 40); the identifier features carry them
_NOT_MEANING = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\S*\d\S*")
_SPACES = re.compile(r"\s{2,}")
_SENTENCE = re.compile(r"(?<=[.!?。！？])\s+")
# What is left of a sentence that only gave an identifier ("Order 302-1234567.", "My order number is ...", "email:
# ..."): its words name the identifier and say nothing about the problem. NOTE: "order", "number" and the like are
# frequent in the data's openings, so this residue alone made such a follow-up read like a new problem.
_ONLY_A_REFERENCE = re.compile(
    r"(?i)^\W*(?:(?:my|the|our|this|that|it|its|it's|is|was|for|of|on|to|with|here|here's|fyi|regarding|re|about"
    r"|order|id|no|number|num|tracking|awb|invoice|transaction|txn|reference|ref|account|acct|ticket|case|e-?mail"
    r"|mail|address)\W*)*$"
)


@dataclass(frozen=True, slots=True)
class ShiftFeatures:
    """One message's feature values (in ``FEATURES`` order) and its sentence vector."""

    values: Array
    vector: Array


def shift_features(message: str, found: frozenset[str], state: TopicState, embedder: Embedder) -> ShiftFeatures:
    """The features of ``message`` (naming the identifiers ``found``) against the epoch in ``state``, which must
    hold at least one customer message."""
    words = len(_WORD.findall(message))
    agent = state.agent or ""
    texts = [meaning_text(t) for t in (message, *state.customer, *([agent] if agent else []))]
    vectors = embedder.embed(texts)
    m, customer = vectors[0], vectors[1 : 1 + len(state.customer)]
    cosines = customer @ m
    centroid = customer.mean(axis=0)
    values = [
        np.log1p(words),
        _QUESTION.search(message) is not None,
        len(_ANAPHORA.findall(message)) / max(words, 1),
        _THANKS.search(message) is not None and words <= _SHORT_THANKS_WORDS,
        _CUE.search(message) is not None,
        agent.rstrip().endswith(("?", "？")),
        "?" in agent or "？" in agent,
        _AGENT_OFFERS.search(agent) is not None,
        bool(found & state.identifiers),
        # NOTE: split by whether the epoch had identifiers: one feature for both made the first order number of an
        # issue look like a second order (issue 40)
        (bool(found) or gives_identifier(message)) and not state.identifiers and not state.asked_for_identifier,
        bool(found) and bool(state.identifiers) and not found & state.identifiers and not state.asked_for_identifier,
        state.asked_for_identifier,
        _cosine(m, centroid),
        float(cosines[0]),
        float(cosines.max()),
        float(cosines[-1]),
        float(vectors[-1] @ m) if agent else 0.0,
    ]
    return ShiftFeatures(np.asarray(values, dtype=np.float32), m)


def meaning_text(text: str) -> str:
    """``text`` as the sentence vectors read it: without any token that holds a digit, nor e-mail addresses, nor a
    sentence that only gave such an identifier."""
    kept = []
    for sentence in _SENTENCE.split(text):
        left = _SPACES.sub(" ", _NOT_MEANING.sub(" ", sentence)).strip()
        if left and not (left != sentence.strip() and _ONLY_A_REFERENCE.match(left)):
            kept.append(left)
    return " ".join(kept)


def gives_identifier(message: str) -> bool:
    """Whether ``message`` holds an e-mail address or an id-like token with at least 6 digits."""
    if _EMAIL.search(message):
        return True
    return any(sum(c.isdigit() for c in token) >= _ID_DIGITS for token in _ID_TOKEN.findall(message))


def _cosine(a: Array, b: Array) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm > 0 else 0.0
