"""The topic scorers by name, as a tenant's ``similarity_backend`` setting names them (see ``topic.py``).

Models load on first use: the classifiers' weights and the MiniLM files are read once per process by the caller
that keeps the scorer (``backend/services/shared_scorer.py``).
"""

from __future__ import annotations

from backend.context.errors import UnknownBackendError
from backend.context.shift_classifier import ShiftClassifier, ShiftModel, model_path
from backend.context.similarity import MiniLMSimilarity, TfidfSimilarity
from backend.context.static_embedding import StaticEmbedder
from backend.context.topic import CosineScorer, NoShift, ShiftScorer

SCORERS = ("clf-static", "clf-minilm", "minilm", "tfidf", "none")


def make_scorer(name: str, minilm: MiniLMSimilarity | None = None) -> ShiftScorer:
    """The scorer called ``name``; ``minilm`` shares one MiniLM encoder (and its cache) between scorers."""
    if name == "clf-static":
        embedder = StaticEmbedder()
        return ShiftClassifier(ShiftModel.load(model_path(embedder.name)), embedder, name)
    if name == "clf-minilm":
        encoder = minilm or MiniLMSimilarity()
        return ShiftClassifier(ShiftModel.load(model_path(encoder.name)), encoder, name)
    if name == "minilm":
        return CosineScorer(minilm or MiniLMSimilarity())
    if name == "tfidf":
        return CosineScorer(TfidfSimilarity())
    if name == "none":
        return NoShift()
    raise UnknownBackendError(f"unknown topic scorer {name!r} (known: {', '.join(SCORERS)})")
