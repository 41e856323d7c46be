"""Which handbook section(s) a topic's prompt holds: ranked for the customer's messages of the epoch, and kept for
the epoch unless the topic clearly moves.

Ranking (``SectionIndex.scores``): BM25 over each section's title and text (``bm25s``, English stop words, Snowball
stems), mixed with the cosine of static sentence vectors (``StaticEmbedder``, the topic scorer's own), each scaled to
[0, 1] over the sections. ``bench/grounding.py`` reports the top-1 flow accuracy of BM25 alone, the vectors alone
and the mix on a labelled set of customer requests; the mix's weight was chosen on its dev split only.

Choosing (``choose``): the epoch's customer messages are read in order, the query growing with each. The first
message whose best section scores at least ``min_score`` picks it (and the runner-up when it scores within
``second_ratio`` of it: at most two); later messages keep the choice unless another section beats the kept one by
``switch_margin`` (no flapping turn to turn). Replaying the epoch gives the same choice in every worker, with nothing
stored but the result (``topic_history.sections``, for the admin API and the dashboard).

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


class Embedder(Protocol):
    def embed(self, texts: Sequence[str]) -> Array: ...


@dataclass(frozen=True, slots=True)
class ChoiceSettings:
    """``bm25_weight``: the mix of BM25 and vector scores (1: BM25 alone); the rest as in the module's docstring."""

    bm25_weight: float = 0.3  # chosen on the dev split of bench/data/handbook_requests.jsonl
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
        self._vectors = embedder.embed(texts) if embedder is not None and self.sections else None

    def _tokens(self, texts: list[str]) -> list[list[str]]:
        with _STEMMER_LOCK:  # NOTE: a Snowball stemmer object is not thread-safe
            out = bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, return_ids=False, show_progress=False)
        return [list(t) for t in out]

    def scores(self, query: str, bm25_weight: float) -> Array:
        """Every section's score for ``query`` in [0, 1]: ``bm25_weight`` of BM25, the rest vector cosine."""
        n = len(self.sections)
        if n == 0 or not query.strip():
            return np.zeros(n, dtype=np.float32)
        tokens = self._tokens([query])[0]
        lexical = self._bm25.get_scores(tokens) if tokens else np.zeros(n, dtype=np.float32)
        mixed = bm25_weight * _unit_max(np.asarray(lexical, dtype=np.float32))
        if self._vectors is not None and self._embedder is not None and bm25_weight < 1.0:
            cosine = self._vectors @ self._embedder.embed([query])[0]
            mixed = mixed + (1.0 - bm25_weight) * _min_max(cosine) * float(lexical.max() > 0 or cosine.max() > 0)
        return mixed

    def ranked(self, query: str, bm25_weight: float) -> list[Ranked]:
        scores = self.scores(query, bm25_weight)
        return [Ranked(int(i), float(scores[i])) for i in np.argsort(-scores, kind="stable")]


def choose(index: SectionIndex, messages: Sequence[str], settings: ChoiceSettings) -> tuple[int, ...]:
    """The sections (positions, best first; at most two) for an epoch whose customer messages are ``messages``."""
    chosen: tuple[int, ...] = ()
    query = ""
    for message in messages:
        query = f"{query}\n{message}" if query else message
        ranked = index.ranked(query, settings.bm25_weight)
        if not ranked or ranked[0].score < settings.min_score:
            continue
        best = ranked[0]
        if chosen:
            kept = next(r.score for r in ranked if r.index == chosen[0])
            if best.index == chosen[0] or best.score < kept + settings.switch_margin:
                continue
        second = ranked[1] if len(ranked) > 1 else None
        if second is not None and second.score >= settings.second_ratio * best.score:
            chosen = (best.index, second.index)
        else:
            chosen = (best.index,)
    return chosen


def _unit_max(x: Array) -> Array:
    top = float(x.max()) if x.size else 0.0
    return x / top if top > 0 else np.zeros_like(x)


def _min_max(x: Array) -> Array:
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
