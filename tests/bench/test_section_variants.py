"""bench/section_variants.py's arithmetic on a hand-made problem (the full run embeds 1,100 texts and fits ~200
regressions, a benchmark's job): flow accuracy per split, reading scores per flow, a fold never scored by its own
examples, and a weight picked on dev alone."""

from __future__ import annotations

import numpy as np

from bench import section_variants as sv

# Three sections: two of flow 0, one of flow 1. Four requests: two dev (folds 0 and 1), two held-out.
EMPTY = np.zeros((0, 2), dtype=np.float32)
DATA = sv.Data(
    titles=["A: x", "A: y", "B: z"],
    group=np.array([0, 0, 1]),
    query=np.eye(4, 2, dtype=np.float32),
    truth=np.array([0, 1, 0, 1]),
    dev=np.array([True, True, False, False]),
    fold=np.array([0, 1, -1, -1]),
    bm25=np.zeros((4, 3), dtype=np.float32),
    heads=EMPTY,
    title_vectors=EMPTY,
    lines=EMPTY,
    line_of=np.zeros(0, dtype=int),
    examples=EMPTY,
    example_of=np.array([0, 2]),
    example_fold=np.array([0, 1]),
    example_texts=["e0", "e1"],
    texts=["q0", "q1", "q2", "q3"],
    section_texts=["", "", ""],
)


def test_accuracy_is_the_best_sections_flow_per_split() -> None:
    scores = np.array([[0.1, 0.9, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    assert sv.accuracy(DATA, scores) == (1.0, 0.0)


def test_a_flow_reads_the_best_the_sum_or_the_two_best_of_its_sections() -> None:
    scores = np.array([[0.4, 0.4, 0.7]] * 4, dtype=np.float32)
    assert np.allclose(sv._flow_scores(DATA, scores, "best")[0], [0.4, 0.7])
    assert np.allclose(sv._flow_scores(DATA, scores, "two best")[0], [0.8, 0.7])
    assert np.allclose(sv._flow_scores(DATA, scores, "sum")[0], [0.8, 0.7])


def test_each_request_is_scored_without_its_folds_examples() -> None:
    seen: list[list[bool]] = []

    def score(kept: np.ndarray) -> np.ndarray:
        seen.append(kept.tolist())
        return np.tile(kept.astype(np.float32)[[0, 1, 1]], (4, 1))  # the row tells which examples were kept

    out = sv.per_fold(DATA, score)
    assert seen == [[True, True], [False, True], [True, False]]  # held-out: all; fold 0: not e0; fold 1: not e1
    assert out[0].tolist() == [0.0, 1.0, 1.0] and out[1].tolist() == [1.0, 0.0, 0.0]
    assert out[2].tolist() == out[3].tolist() == [1.0, 1.0, 1.0]


def test_the_weight_is_picked_on_dev_only_the_smallest_on_a_tie() -> None:
    base = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    # The extra part fixes dev request 0 from g = 3 on (it also moves the held-out ones: they must not count).
    extra = np.array([[0.34, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    fused, g = sv._picked(DATA, base, extra)
    assert g == 3.0
    assert sv.accuracy(DATA, fused) == (1.0, 0.5)
