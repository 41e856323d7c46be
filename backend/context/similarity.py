"""How close a new customer message is to the current topic: one small interface, two backends.

``similarity(message, context)`` returns a cosine in [0, 1] between the message and the topic's recent messages
(customer and agent, oldest first).

- ``tfidf``: TF-IDF (scikit-learn) fitted on the context plus the message, cosine of the message with the context's
  centroid. No model; weak on paraphrase.
- ``minilm``: all-MiniLM-L6-v2 sentence embeddings (``minilm.py``), cosine with the centroid of the context's
  embeddings. Embeddings are cached per text (a session re-reads its window on every message).

``topic.CosineScorer`` turns either into a topic scorer; ``bench/topic_shift.py`` measures both next to the
topic-shift classifier (whose ``clf-minilm`` variant embeds with ``MiniLMSimilarity.embed``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from backend.context.errors import UnknownBackendError
from backend.context.minilm import Array, MiniLMEncoder


class SimilarityBackend(Protocol):
    name: str

    def similarity(self, message: str, context: Sequence[str]) -> float: ...


def _centroid_cosine(message: Array, context: Array) -> float:
    centroid = context.mean(axis=0)
    norm = float(np.linalg.norm(centroid) * np.linalg.norm(message))
    return max(0.0, float(message @ centroid) / norm) if norm > 0 else 0.0


class TfidfSimilarity:
    """TF-IDF over the topic's own messages: words (and word pairs) the topic shares with the message."""

    name = "tfidf"

    def similarity(self, message: str, context: Sequence[str]) -> float:
        if not context:
            return 0.0
        vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, stop_words="english")
        try:
            matrix = vectorizer.fit_transform([*context, message]).toarray().astype(np.float32)
        except ValueError:  # NOTE: every word was a stop word (e.g. "ok thanks"): no evidence either way
            return 0.0
        return _centroid_cosine(matrix[-1], matrix[:-1])


class MiniLMSimilarity:
    """Sentence embeddings of all-MiniLM-L6-v2 (packaged, no download), with a bounded per-text cache."""

    name = "minilm"

    def __init__(self, encoder: MiniLMEncoder | None = None, cache_size: int = 4096) -> None:
        self.encoder = encoder or MiniLMEncoder()
        self._cache: OrderedDict[str, Array] = OrderedDict()
        self._cache_size = cache_size

    def embed(self, texts: Sequence[str]) -> Array:
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if missing:
            for text, vector in zip(missing, self.encoder.encode(missing), strict=True):
                self._cache[text] = vector
        out = np.stack([self._cache[t] for t in texts])
        for text in texts:
            self._cache.move_to_end(text)
        while len(self._cache) > self._cache_size:  # NOTE: after reading: this call's own texts may go too
            self._cache.popitem(last=False)
        return out

    def similarity(self, message: str, context: Sequence[str]) -> float:
        if not context:
            return 0.0
        vectors = self.embed([*context, message])
        return _centroid_cosine(vectors[-1], vectors[:-1])


def make_backend(name: str) -> SimilarityBackend:
    """The backend called ``name`` (``tfidf`` or ``minilm``)."""
    if name == "tfidf":
        return TfidfSimilarity()
    if name == "minilm":
        return MiniLMSimilarity()
    raise UnknownBackendError(f"unknown similarity backend {name!r} (known: tfidf, minilm)")
