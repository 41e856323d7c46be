"""bench/structured_output.py end to end on the tiny model, a few prompts and rounds (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import structured_output


def test_validity_and_neighbours_are_reported(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    argv = ["--model", str(tiny_model_dir), "--prompts", "3", "--max-tokens", "8", "--batch", "3"]
    argv += ["--grammar-rows", "1", "--decode-tokens", "4", "--repeats", "1", "--out", str(out)]
    assert structured_output.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["validity"]["prompts"] == 3
    assert 0 <= result["validity"]["valid"] <= 3
    cost = result["neighbours"]
    assert (cost["batch"], cost["grammar_rows"], cost["decode_tokens"]) == (3, 1, 4)
    assert cost["ratio"] > 0
    assert len(cost["samples"]["control"]) == len(cost["samples"]["mixed"]) == 1


def test_drafts_off_and_on_are_compared_on_both_workloads(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "drafts.json"
    argv = ["--model", str(tiny_model_dir), "--drafts", "--prompts", "2", "--max-tokens", "12"]
    assert structured_output.main([*argv, "--tool-max-tokens", "12", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [w["workload"] for w in result["workloads"]] == ["json_schema", "tool_call"]
    for w in result["workloads"]:
        assert w["off"]["replies"] == w["on"]["replies"] == 2
        assert w["off"]["drafted_tokens"] == 0  # the off side asked for none
        assert w["mismatches"] == 0  # greedy: drafts never change a reply
        assert w["paired_median_speedup"] > 0
        assert w["off"]["decode_tokens_per_step"] == 1.0
