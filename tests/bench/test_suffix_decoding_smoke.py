"""bench/suffix_decoding.py end to end on the tiny model: both parts run, and greedy replies agree off and on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import suffix_decoding
from engine.spec import suffix_drafts


@pytest.mark.skipif(not suffix_drafts.available(), reason="needs the spec extra (arctic-inference)")
def test_one_and_many_sessions_run_with_drafts_off_and_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sd.json"
    argv = ["--model", str(tiny_model_dir), "--dtype", "float32", "--conversations", "1", "--turns", "2"]
    argv += ["--sessions", "2", "--max-tokens", "8", "--policy-chars", "200", "--out", str(out)]
    assert suffix_decoding.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["one_session"]["greedy_mismatches"] == 0
    assert result["one_session"]["off"]["replies"] == result["one_session"]["on"]["replies"] == 2
    assert set(result["many_sessions"]) == {"off", "on", "greedy_mismatches"}
    assert "--sessions 2" in result["command"]
