"""Which handbook section(s) a topic's prompt holds: ranked for the customer's messages of the epoch, and kept for
the epoch unless the topic clearly moves.

Ranking (``SectionIndex.scores``), each part scaled to [0, 1] over the sections, then mixed:

- BM25 over each section's title and text (``bm25s``, English stop words, Snowball stems);
- the cosine of the query's sentence vector (all-MiniLM-L6-v2) with the section's head (its title and first
  ``HEAD_CHARS`` characters: a section's opening says what it is about, and a short text embeds fast);
- when the handbook gives example customer questions, the best cosine with one of the section's examples;
- and then the probability of the section's group (the title's part before ``": "``) from a classifier fitted on
  the handbook's own examples, titles and heads (``backend/context/section_classifier.py``).

``bench/grounding.py`` reports the top-1 flow accuracy of each part and the mix on a labelled set of customer
requests (``bench/data/handbook_requests.jsonl``); the weights were chosen on its dev split only.

Choosing (``choose``): the epoch's customer messages are read in order, the query growing with each. The first
message whose best section scores at least ``min_score`` picks it (and the runner-up when it scores within
``second_ratio`` of it: at most two); later messages keep the choice unless another section beats the kept one by
``switch_margin`` (no flapping turn to turn). Replaying the epoch gives the same choice in every worker, with nothing
stored but the result (``topic_history.sections``, for the admin API and the dashboard).

NOTE: a grown query's sentence vector is the mean of its messages' vectors (unit-scaled), not the vector of the
joined text: each message is encoded once and then found in the embedder's cache, where the joined text was a new
text every turn (one MiniLM pass over the whole epoch per customer message). A one-message query's vector is the
message's own, so a single request ranks exactly as before; BM25 still reads the joined text (it costs little).

Pure: no database, no engine.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import bm25s
import numpy as np
import Stemmer

from backend.context.handbook import Section
from backend.context.minilm import Array
from backend.context.section_classifier import GroupClassifier, title_texts


class Embedder(Protocol):
    def embed(self, texts: Sequence[str]) -> Array: ...


HEAD_CHARS = 200


@dataclass(frozen=True, slots=True)
class ChoiceSettings:
    """``bm25_weight``: the share of BM25 against the head vectors (1: BM25 alone); ``example_weight``: what the
    examples add; ``group_weight``: what the group classifier adds; the rest as in the module's docstring. The
    weights were chosen on the dev split of bench/data/handbook_requests.jsonl (a dev request's own example never
    scores it; docs/context.md has the variants tried)."""

    bm25_weight: float = 0.3
    example_weight: float = 2.0
    group_weight: float = 0.75
    min_score: float = 0.2
    switch_margin: float = 0.25
    second_ratio: float = 0.95


@dataclass(frozen=True, slots=True)
class Ranked:
    index: int  # the section's position in the handbook
    score: float


_STEMMER_LOCK = threading.Lock()


class SectionIndex:
    """The sections of one handbook version, indexed for ``scores`` (built once per version, shared by sessions)."""

    def __init__(self, sections: Sequence[Section], embedder: Embedder | None = None) -> None:
        self.sections = tuple(sections)
        self._stemmer = Stemmer.Stemmer("english")
        texts = [f"{s.title}\n{s.title}\n{s.text}" for s in self.sections]  # NOTE: the title weighs twice
        self._bm25 = bm25s.BM25()
        if self.sections:
            self._bm25.index(self._tokens(texts), show_progress=False)
        self._embedder = embedder
        self._heads: Array | None = None
        self._examples: Array | None = None
        self._example_of: list[int] = []
        self._groups: GroupClassifier | None = None
        if embedder is not None and self.sections:
            self._heads = embedder.embed([f"{s.title}. {s.text[:HEAD_CHARS]}" for s in self.sections])
            self._example_of = [i for i, s in enumerate(self.sections) for _ in s.examples]
            if self._example_of:
                self._examples = embedder.embed([e for s in self.sections for e in s.examples])
            if self._examples is not None and GroupClassifier.fits(self.sections):
                self._groups = GroupClassifier(
                    self.sections, self._heads, embedder.embed(title_texts(self.sections)), self._examples
                )

    @property
    def groups_fitted(self) -> bool:
        """Whether the ranking has a group classifier (a handbook with examples and at least two groups)."""
        return self._groups is not None

    def _tokens(self, texts: list[str]) -> list[list[str]]:
        with _STEMMER_LOCK:  # NOTE: a Snowball stemmer object is not thread-safe
            out = bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, return_ids=False, show_progress=False)
        return [list(t) for t in out]

    def embed(self, texts: Sequence[str]) -> Array | None:
        """The texts' sentence vectors (one row each), or None when the index ranks without vectors."""
        if self._heads is None or self._embedder is None or not texts:
            return None
        return self._embedder.embed(texts)

    def scores(
        self,
        query: str,
        bm25_weight: float,
        example_weight: float = 0.0,
        group_weight: float = 0.0,
        vector: Array | None = None,
    ) -> Array:
        """Every section's score for ``query``: ``bm25_weight`` of BM25 and the rest head cosine (each in [0, 1]),
        plus ``example_weight`` times the examples' score and ``group_weight`` times its group's probability; scaled
        so the best possible is 1. ``vector``: the query's unit sentence vector when the caller has it (else it is
        encoded here)."""
        n = len(self.sections)
        if n == 0 or not query.strip():
            return np.zeros(n, dtype=np.float32)
        tokens = self._tokens([query])[0]
        lexical = np.asarray(self._bm25.get_scores(tokens) if tokens else np.zeros(n), dtype=np.float32)
        mixed = bm25_weight * _unit_max(lexical)
        total = bm25_weight
        if self._heads is not None and self._embedder is not None and bm25_weight < 1.0:
            if vector is None:
                vector = self._embedder.embed([query])[0]
            mixed = mixed + (1.0 - bm25_weight) * _min_max(self._heads @ vector)
            total = 1.0
            if self._examples is not None and example_weight > 0:
                best = np.zeros(n, dtype=np.float32)
                np.maximum.at(best, self._example_of, self._examples @ vector)
                mixed = mixed + example_weight * _min_max(best)
                total += example_weight
            if self._groups is not None and group_weight > 0:
                mixed = mixed + group_weight * self._groups.proba(vector)
                total += group_weight
        return mixed / total if total > 0 else mixed

    def ranked(
        self,
        query: str,
        bm25_weight: float,
        example_weight: float = 0.0,
        group_weight: float = 0.0,
        vector: Array | None = None,
    ) -> list[Ranked]:
        scores = self.scores(query, bm25_weight, example_weight, group_weight, vector)
        return [Ranked(int(i), float(scores[i])) for i in np.argsort(-scores, kind="stable")]


def choose(index: SectionIndex, messages: Sequence[str], settings: ChoiceSettings) -> tuple[int, ...]:
    """The sections (positions, best first; at most two) for an epoch whose customer messages are ``messages``."""
    chosen: tuple[int, ...] = ()
    query = ""
    vectors = index.embed(messages) if settings.bm25_weight < 1.0 else None  # (cached: only a new message encodes)
    for n, message in enumerate(messages):
        query = f"{query}\n{message}" if query else message
        vector = None if vectors is None else vectors[0] if n == 0 else _unit(vectors[: n + 1].mean(axis=0))
        weights = (settings.bm25_weight, settings.example_weight, settings.group_weight)
        chosen = next_choice(chosen, index.ranked(query, *weights, vector=vector), settings)
    return chosen


def next_choice(chosen: tuple[int, ...], ranked: Sequence[Ranked], settings: ChoiceSettings) -> tuple[int, ...]:
    """The sections after one more message, from its ranking: the ones ``chosen`` so far unless a clearly better one
    passes ``min_score`` (by ``switch_margin``); a close second (``second_ratio``) joins the best."""
    if not ranked or ranked[0].score < settings.min_score:
        return chosen
    best = ranked[0]
    if chosen:
        kept = next(r.score for r in ranked if r.index == chosen[0])
        if best.index == chosen[0] or best.score < kept + settings.switch_margin:
            return chosen
    second = ranked[1] if len(ranked) > 1 else None
    if second is not None and second.score >= settings.second_ratio * best.score:
        return (best.index, second.index)
    return (best.index,)


def _unit(x: Array) -> Array:
    norm = float(np.linalg.norm(x))
    return (x / norm).astype(np.float32) if norm > 0 else x


def _unit_max(x: Array) -> Array:
    top = float(x.max()) if x.size else 0.0
    return x / top if top > 0 else np.zeros_like(x)


def _min_max(x: Array) -> Array:
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
