"""``bench.scale_out`` end to end at the smallest scale (two sessions of two turns, the tiny model), so it cannot rot.
No performance assertions: only that it runs all three scenarios and writes its JSON with the figures it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scale_out

pytestmark = pytest.mark.skipif(not scale_out.ROUTER.exists(), reason="vllm-router is not installed")


def test_scale_out_replays_every_scenario_and_writes_its_report(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale_out.json"
    argv = ["--model", str(tiny_model_dir), "--sessions", "2", "--turns", "2", "--latency-requests", "3"]
    assert scale_out.main([*argv, "--kv-mb", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    scenarios = report["scenarios"]
    assert set(scenarios) == {"one_replica", "consistent_hash", "round_robin", "router_latency"}
    for name in ("one_replica", "consistent_hash", "round_robin"):
        assert scenarios[name]["requests"] == report["requests"] == 4
        assert 0.0 <= scenarios[name]["hit_rate"] < 1.0
    assert scenarios["consistent_hash"]["hit_rate_turn2_on"] > 0  # turn 2 of a session hits its replica
    assert {"added_ms_p50", "added_ms_p99"} <= set(scenarios["router_latency"])
    assert [p["replicas"] for p in report["projection"]] == [1, 2, 4, 8]
    assert report["command"].startswith("flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.scale_out")
    assert "cpu_kind" in report["machine"]
    assert "Router added latency" in capsys.readouterr().out
