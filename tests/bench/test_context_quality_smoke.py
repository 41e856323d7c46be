"""bench/context_quality.py on the tiny model: it runs on any file, scores every row in every epoch, writes JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.domain import MessageRole
from bench import context_quality
from bench.context_quality import Turn, scored_replies
from bench.datasets import CONVERSATIONS, read_text


def test_one_session_is_scored_under_every_row_plain_and_masked(tiny_model_dir: Path, tmp_path: Path) -> None:
    # (the vendored data: bench/data/, no folder outside the repository)
    assert context_quality.DEFAULT_DATA.is_relative_to(context_quality.REPO / "bench" / "data")
    out = tmp_path / "cq.json"
    argv = ["--model", str(tiny_model_dir), "--sessions", "1", "--conversations-per-session", "2"]
    argv += ["--score-per-conversation", "1"]
    assert context_quality.main([*argv, "--policy-chars", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["plain", "masked"]
    for rows in result["results"].values():
        assert list(rows) == ["full", "epoch", "epoch-typed", "oracle", "budget"]
        assert rows["full"]["nll_vs_full_pct"] == 0.0 and rows["full"]["tokens_vs_full"] == 1.0
        # one reply of each of the two conversations: both epochs are scored
        assert all(r["replies"] == 2 and r["nll"] > 0 and r["prompt_tokens"] > 0 for r in rows.values())
        assert rows["budget"]["prompt_tokens"] <= 1024  # the budget policy's own limit
        assert rows["oracle"]["prompt_tokens"] < rows["full"]["prompt_tokens"]  # the true seam drops the first topic


def test_a_small_file_still_has_held_out_sessions(tmp_path: Path) -> None:
    lines = read_text(CONVERSATIONS).splitlines()[:8]  # a file of 8 lines: its last 4 are the held-out half
    data = tmp_path / "small.jsonl"
    data.write_text("\n".join(lines) + "\n")
    sessions = context_quality.load_sessions(data, 5, 2)
    assert len(sessions) == 2
    assert sessions[0][0].text == json.loads(lines[4])["turns"][0]["content"]
    assert {t.conversation for t in sessions[1]} == {0, 1}


def test_the_last_replies_of_every_conversation_are_scored() -> None:
    a, u = MessageRole.ASSISTANT, MessageRole.USER
    turns = [Turn(r, "x", k) for k, roles in enumerate([(u, a, u, a), (u, a, u, a, u, a)]) for r in roles]
    assert scored_replies(turns, 1) == {3, 9}
    assert scored_replies(turns, 2) == {1, 3, 7, 9}


@pytest.mark.parametrize("missing", ["--data", "--guidelines"])
def test_a_missing_file_is_one_line(tmp_path: Path, missing: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.json"
    assert context_quality.main([missing, str(path)]) == 1
    assert (
        capsys.readouterr().err
        == f"error: {path} not found (nor nope.json.xz) (the vendored data lives in bench/data/)\n"
    )
