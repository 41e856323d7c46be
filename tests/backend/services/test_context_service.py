"""The context service's process-wide topic scorers: one per name, MiniLM (and its lock) shared by its users."""

from __future__ import annotations

from backend.context.shift_classifier import ShiftClassifier
from backend.services.context_service import shared_scorer


def test_scorers_are_shared_per_name_and_minilm_users_share_one_encoder_and_lock() -> None:
    cosine, classifier, static = shared_scorer("minilm"), shared_scorer("clf-minilm"), shared_scorer("clf-static")
    assert shared_scorer("minilm") is cosine
    assert cosine.minilm is not None and classifier.minilm is cosine.minilm
    assert classifier.lock is cosine.lock  # (the encoder's embedding cache is one OrderedDict)
    assert static.minilm is None and static.lock is not cosine.lock


def test_prepare_fills_the_classifiers_cache_and_is_a_no_op_for_the_others() -> None:
    static = shared_scorer("clf-static")
    static.prepare("Your replacement ships tomorrow.")
    inner = static._scorer
    assert isinstance(inner, ShiftClassifier)
    assert "Your replacement ships tomorrow." in inner.embedder._cache  # type: ignore[attr-defined]
    shared_scorer("tfidf").prepare("Your replacement ships tomorrow.")  # nothing to embed: no error
