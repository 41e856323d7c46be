"""The topic-shift benchmark end to end on a few hand-written conversations (seconds), and its failure line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_the_benchmark_scores_each_backend_and_writes_its_report(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "topic_shift.json"
    assert topic_shift.main(["--data", str(data), "--pairs", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == ".venv/bin/python -m bench.topic_shift"
    assert report["part"].startswith("held_out")
    assert report["default_backend"] == "minilm"
    assert set(report["results"]) == {"identifiers-only", "tfidf", "tfidf@0.3", "minilm", "minilm@0.3"}
    assert report["results"]["minilm@0.3"]["settings"]["shift_threshold"] == 0.3
    for name in ("identifiers-only", "tfidf", "minilm"):
        score = report["results"][name]["score"]
        # each pair: 2 scored customer messages in the first conversation (after its opening) + 3 in the second
        assert (score["pairs"], score["scored_messages"]) == (2, 10)
        # the seam opens with a new order number: found by the identifier rule, whatever the backend says
        assert (score["true_shifts"], score["missed_shifts"], score["recall"]) == (2, 0, 1.0)
        assert score["false_shifts"] == 0 and score["false_shift_rate"] == 0.0 and score["f1"] == 1.0


def test_a_missing_data_file_fails_with_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert topic_shift.main(["--data", str(missing), "--backends", "tfidf"]) == 2
    err = capsys.readouterr().err
    assert err == f"topic_shift: data file not found: {missing} (pass --data PATH)\n"


def test_too_few_pairs_in_a_part_is_an_error(data: Path) -> None:
    with pytest.raises(SystemExit, match="the held_out part has only 2 pairs, 3 asked"):
        topic_shift.main(["--data", str(data), "--pairs", "3", "--backends", "tfidf"])
