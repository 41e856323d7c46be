"""bench/shift_pmi.py end to end on the tiny model and one pair per part and set (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import shift_pmi


def test_every_candidate_is_reported_per_set(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "pmi.json"
    assert shift_pmi.main(["--pairs", "1", "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"pmi", "clf-static", "clf-static+pmi"}
    for candidate in result["results"].values():
        assert candidate["masked"]["messages"] > 1 and candidate["second-issue"]["messages"] > 1
        assert 0.0 <= candidate["masked"]["recall"] <= 1.0
    assert result["seconds_per_message"] > 0


def test_the_threshold_keeps_false_shifts_at_most_the_limit() -> None:
    scores = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0])
    seams = np.array([False] * 10 + [True])
    t = shift_pmi.threshold_at(scores, seams, 0.1)
    assert t == 0.9  # one negative of ten (1.0) is over it: 10 %
    assert shift_pmi.report(scores, seams, t) == {"recall": 1.0, "false_shift_rate": 0.1, "messages": 11}
