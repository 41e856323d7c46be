"""The topic scorers of the process: one instance each, shared by the worker threads that score customer messages.

Weights load once, on first use; the embedding caches are not thread-safe, so each scorer runs under a lock, and
the scorers that use the MiniLM encoder share it (and its lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from backend.context.minilm import Array
from backend.context.scorers import make_scorer
from backend.context.similarity import MiniLMSimilarity
from backend.context.topic import ShiftScorer, TopicSettings, TopicState


class LockedScorer:
    """A topic scorer shared by worker threads (the embedding caches are not thread-safe). Scorers that share the
    MiniLM encoder share its lock too."""

    def __init__(self, scorer: ShiftScorer, minilm: MiniLMSimilarity | None, lock: threading.Lock) -> None:
        self.name = scorer.name
        self.minilm = minilm
        self._scorer = scorer
        self.lock = lock

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float:
        with self.lock:
            return self._scorer.on_topic(message, found, state, settings)

    def prepare(self, text: str) -> None:
        """Embed an agent reply now, so the customer's next message finds it cached (a no-op for other scorers)."""
        prepare = getattr(self._scorer, "prepare", None)
        if prepare is not None:
            with self.lock:
                prepare(text)


_SCORERS: dict[str, LockedScorer] = {}
_SCORERS_LOCK = threading.Lock()
_USES_MINILM = frozenset({"minilm", "clf-minilm"})


def shared_scorer(name: str) -> LockedScorer:
    """One instance per scorer for the process: weights are loaded once, on first use; the MiniLM encoder (and its
    embedding cache) is shared by the scorers that use it."""
    with _SCORERS_LOCK:
        if name not in _SCORERS:
            minilm, lock = None, threading.Lock()
            if name in _USES_MINILM:
                sharing = next((s for s in _SCORERS.values() if s.minilm is not None), None)
                minilm, lock = (sharing.minilm, sharing.lock) if sharing else (MiniLMSimilarity(), lock)
            _SCORERS[name] = LockedScorer(make_scorer(name, minilm), minilm, lock)
        return _SCORERS[name]


class _LockedEmbedder:
    """The MiniLM sentence encoder for ranking handbook sections, shared by the threads of the process (its vector
    cache is not thread-safe)."""

    def __init__(self) -> None:
        self._embedder = MiniLMSimilarity()
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> Array:
        with self._lock:
            return self._embedder.embed(texts)


_EMBEDDER: list[_LockedEmbedder] = []


def section_embedder() -> _LockedEmbedder:
    """The process's sentence encoder for ranking handbook sections (loaded on first use)."""
    with _SCORERS_LOCK:
        if not _EMBEDDER:
            _EMBEDDER.append(_LockedEmbedder())
        return _EMBEDDER[0]
