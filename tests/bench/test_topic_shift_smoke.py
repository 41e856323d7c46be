"""The topic-shift benchmark end to end on a few hand-written conversations (seconds), and its failure line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.context.shift_classifier import ShiftModel
from bench import topic_shift

ORDERS = [
    ("Order #111-1111111-1111111 arrived with a cracked screen on the phone.", "phone screen cracked replacement"),
    ("My refund for order #222-2222222-2222222 never reached my bank account.", "refund bank account missing"),
    ("The shoes from order #333-3333333-3333333 are two sizes too small.", "shoes wrong size exchange"),
    ("Order #444-4444444-4444444 was delivered to the wrong address entirely.", "delivered wrong address"),
]


def _conversation(opening: str, topic: str) -> dict[str, object]:
    turns = [
        ("user", opening),
        ("agent", f"I am sorry to hear that. Let me look into the {topic} issue for you right away."),
        ("User", f"Please hurry, the {topic} problem is really annoying me."),
        ("Agent", f"I have escalated the {topic} case and you will hear from us within two days."),
        ("user", "ok thanks, bye"),
    ]
    return {"id": topic, "turns": [{"role": r, "content": c} for r, c in turns]}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "convs.jsonl"
    rows = [_conversation(*pair) for pair in ORDERS * 2]  # 8 conversations: 4 tuning, 4 held out = 2 pairs
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_benchmark_scores_each_scorer_on_each_set_and_writes_its_report(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "topic_shift.json"
    assert (
        topic_shift.main(["--data", str(data), "--pairs", "2", "--scorers", "clf-static,tfidf", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["command"] == ".venv/bin/python -m bench.topic_shift"
    assert report["part"].startswith("held_out")
    assert report["default_scorer"] == "clf-static"
    assert list(report["results"]) == ["spliced", "masked", "second-issue", "second-issue-cued", "identifier-mid-issue"]
    for kind, rows in report["results"].items():
        assert list(rows) == ["identifiers-only", "clf-static", "tfidf"]
        # each pair: 2 scored customer messages in the first conversation (after its opening), then the second's
        # 3 (spliced, masked) or only its opening (second-issue sets); identifier-mid-issue: each conversation
        # alone (4 sessions, no seam), its 2 messages after the opening
        shape = {"spliced": (2, 2, 10), "masked": (2, 2, 10), "identifier-mid-issue": (4, 0, 8)}.get(kind, (2, 2, 6))
        got = {(r["score"]["sessions"], r["score"]["seams"], r["score"]["scored_messages"]) for r in rows.values()}
        assert got == {shape}
    identifiers = {kind: rows["identifiers-only"]["score"] for kind, rows in report["results"].items()}
    # the seam opens with a new order number: the identifier rule finds it, until the numbers are gone
    assert (identifiers["spliced"]["true_shifts"], identifiers["spliced"]["false_shifts"]) == (2, 0)
    assert [identifiers[k]["true_shifts"] for k in ("masked", "second-issue", "second-issue-cued")] == [0, 0, 0]
    # an issue's first identifier, given mid-issue, is no reason to shift
    mid_issue = identifiers["identifier-mid-issue"]
    assert (mid_issue["probes"], mid_issue["false_shifts"], mid_issue["probe_shifts"]) == (4, 0, 0)


def test_training_writes_a_model_the_scorer_loads(data: Path, tmp_path: Path) -> None:
    assert (
        topic_shift.main(["--data", str(data), "--train", "--scorers", "clf-static", "--model-dir", str(tmp_path)]) == 0
    )
    model = ShiftModel.load(tmp_path / "shift_minilm-static.json")
    assert model.embedder == "minilm-static"
    assert model.trained["command"] == ".venv/bin/python -m bench.topic_shift --train --scorers clf-static"
    assert model.trained["tuning_pairs"] == 2
    assert 0.05 <= model.shift_threshold <= 0.95


def test_a_missing_data_file_fails_with_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert topic_shift.main(["--data", str(missing), "--scorers", "tfidf"]) == 2
    err = capsys.readouterr().err
    assert err == f"topic_shift: data file not found: {missing} (pass --data PATH)\n"


def test_too_few_pairs_in_a_part_is_an_error(data: Path) -> None:
    with pytest.raises(SystemExit, match="the held_out part has only 2 pairs, 3 asked"):
        topic_shift.main(["--data", str(data), "--pairs", "3", "--scorers", "tfidf"])
