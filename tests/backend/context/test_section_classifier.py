"""The per-handbook group classifier (pure, with a word-count embedder instead of MiniLM): a section's group is its
title's part before ": ", the classifier is fitted only when the handbook has examples and two groups, its
probabilities are per group, and in the ranking it moves a request to the group its examples point to."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from backend.context.handbook import Section
from backend.context.minilm import Array
from backend.context.section_classifier import GroupClassifier, group_of, title_texts
from backend.context.sections import ChoiceSettings, SectionIndex, choose

DIM = 256


class WordEmbedder:
    """Unit vectors of hashed word counts: texts that share words are close, as a sentence encoder's would be."""

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, texts: Sequence[str]) -> Array:
        self.calls += 1
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().replace(".", " ").replace(":", " ").split():
                out[row, int(hashlib.sha256(word.encode()).hexdigest(), 16) % DIM] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-9)


SECTIONS = [
    Section("Refunds: Start a refund", "Ask why. Record the reason.", ("money back for my jacket", "refund please")),
    Section("Refunds: Refund status", "Look up the refund.", ("where is my money", "has my refund gone through")),
    Section("Account: Reset password", "Send the reset link.", ("cannot log in", "forgot my password")),
    Section("Account: Change e-mail", "Verify, then change it.", ("new email address", "update my email")),
]


def test_a_group_is_the_title_before_the_colon_or_the_title() -> None:
    assert group_of("Product Defect: Initiate Refund") == "Product Defect"
    assert group_of("Shipping and delivery") == "Shipping and delivery"
    assert group_of(": odd") == ": odd"
    assert title_texts(SECTIONS[:2]) == [
        "Refunds: Start a refund",
        "Refunds: Refund status",
        "Start a refund",
        "Refund status",
    ]


def test_fitted_only_with_examples_and_two_groups() -> None:
    assert GroupClassifier.fits(SECTIONS)
    assert not GroupClassifier.fits([Section(s.title, s.text) for s in SECTIONS])  # no examples
    assert not GroupClassifier.fits(SECTIONS[:2])  # one group: nothing to tell apart


def test_the_probability_is_the_groups_and_follows_its_examples() -> None:
    embedder = WordEmbedder()
    heads = embedder.embed([f"{s.title}. {s.text}" for s in SECTIONS])
    examples = embedder.embed([e for s in SECTIONS for e in s.examples])
    classifier = GroupClassifier(SECTIONS, heads, embedder.embed(title_texts(SECTIONS)), examples)
    p = classifier.proba(embedder.embed(["i forgot my password and cannot log in"])[0])
    assert p[0] == p[1] and p[2] == p[3]  # one value per group
    assert abs(float(p[0] + p[2]) - 1.0) < 1e-5
    assert p[2] > 0.5 > p[0]
    q = classifier.proba(embedder.embed(["i want my money back, refund please"])[0])
    assert q[0] > 0.5 > q[2]


def test_the_ranking_adds_the_group_only_when_a_classifier_was_fitted() -> None:
    embedder = WordEmbedder()
    query = "money back"
    bare = SectionIndex([Section(s.title, s.text) for s in SECTIONS], embedder)
    assert not bare.groups_fitted and not SectionIndex(SECTIONS).groups_fitted  # no examples; no embedder
    assert np.array_equal(bare.scores(query, 0.3, 2.0, 0.75), bare.scores(query, 0.3, 2.0, 0.0))
    index = SectionIndex(SECTIONS, embedder)
    assert index.groups_fitted
    with_group = index.scores(query, 0.3, 2.0, 0.75)
    assert not np.array_equal(with_group, index.scores(query, 0.3, 2.0, 0.0))
    assert float(with_group.max()) <= 1.0
    assert index.sections[int(with_group.argmax())].title.startswith("Refunds: ")
    chosen = choose(index, ["money back for my jacket"], ChoiceSettings())
    assert [index.sections[i].title for i in chosen][:1] == ["Refunds: Start a refund"]


def test_the_same_handbook_gives_the_same_scores_in_every_worker() -> None:
    query = "update my email please"
    first = SectionIndex(SECTIONS, WordEmbedder()).scores(query, 0.3, 2.0, 0.75)
    again = SectionIndex(SECTIONS, WordEmbedder()).scores(query, 0.3, 2.0, 0.75)
    assert np.array_equal(first, again)
