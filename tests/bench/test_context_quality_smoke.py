"""bench/context_quality.py on the tiny model and one spliced session: it runs, scores every policy, writes JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import context_quality


def test_one_session_is_scored_under_every_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    # (the vendored data: bench/data/, no folder outside the repository)
    assert context_quality.DEFAULT_DATA.is_relative_to(context_quality.REPO / "bench" / "data")
    out = tmp_path / "cq.json"
    argv = ["--model", str(tiny_model_dir), "--sessions", "1", "--score-last", "1", "--long-turns", "1"]
    assert context_quality.main([*argv, "--policy-chars", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["all"]
    assert set(rows) == {"full", "epoch", "budget"}
    assert rows["full"]["nll_vs_full_pct"] == 0.0 and rows["full"]["tokens_vs_full"] == 1.0
    assert all(r["replies"] == 1 and r["nll"] > 0 and r["prompt_tokens"] > 0 for r in rows.values())
    assert rows["budget"]["prompt_tokens"] <= 1024  # the budget policy's own limit
    assert result["long"] == rows
