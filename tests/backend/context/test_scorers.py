"""Topic scorers by name: what each name builds, and an unknown name refused with the list of known ones."""

from __future__ import annotations

import pytest

from backend.context.errors import UnknownBackendError
from backend.context.scorers import SCORERS, make_scorer
from backend.context.shift_classifier import ShiftClassifier
from backend.context.similarity import MiniLMSimilarity
from backend.context.static_embedding import StaticEmbedder
from backend.context.topic import CosineScorer, NoShift


def test_each_name_builds_its_scorer_and_minilm_is_shared_when_given() -> None:
    minilm = MiniLMSimilarity()
    static = make_scorer("clf-static")
    full = make_scorer("clf-minilm", minilm)
    cosine = make_scorer("minilm", minilm)
    assert isinstance(static, ShiftClassifier) and isinstance(static.embedder, StaticEmbedder)
    assert isinstance(full, ShiftClassifier) and full.embedder is minilm
    assert isinstance(cosine, CosineScorer) and cosine.backend is minilm
    assert isinstance(make_scorer("tfidf"), CosineScorer)
    assert isinstance(make_scorer("none"), NoShift)
    assert [make_scorer(n, minilm).name for n in SCORERS] == list(SCORERS)


def test_an_unknown_scorer_is_refused_by_name() -> None:
    with pytest.raises(UnknownBackendError) as refused:
        make_scorer("word2vec")
    assert (refused.value.code, str(refused.value)) == (
        "unknown_backend",
        "unknown topic scorer 'word2vec' (known: clf-static, clf-minilm, minilm, tfidf, none)",
    )


def test_the_admin_api_offers_every_scorer() -> None:
    from typing import get_args

    from backend.api.routes.admin_tenant import ContextSettingsIO

    assert get_args(ContextSettingsIO.model_fields["similarity_backend"].annotation) == SCORERS
