"""``bench.tier_restart`` and ``bench.tier_eviction`` end to end at the tiniest scale (the tiny model, a few turns of
hand-written conversations), so they cannot rot. No performance assertions: only that they run (the restart scenario
with its real child processes) and write their reports with the expected keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tier_eviction, tier_restart


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A CuCom-shaped conversation file and an ABCD-shaped handbook, small enough for the tiny model's context."""
    folder = tmp_path / "data"
    folder.mkdir()
    rows = []
    for c in range(8):
        turns = []
        for t in range(4):
            turns.append(
                {"role": "user", "content": f"Order #{123450 + c} item {t} arrived broken. Can I get a refund?"}
            )
            turns.append({"role": "agent", "content": f"Sorry about that. Step {t + 1}: send a photo of the damage."})
        rows.append({"id": f"conv{c}", "turns": turns})
    (folder / "cucom_ecommerce_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    action = {"button": "Pull up order", "text": "Look the order up.", "subtext": ["Ask for the order id."]}
    flow = {"description": "refunds", "subflows": {"refund": {"instructions": ["Verify the id."], "actions": [action]}}}
    (folder / "abcd_guidelines.json").write_text(json.dumps({f"flow{i}": flow for i in range(3)}))
    return folder


def test_tier_restart_runs_both_scenarios_and_writes_its_report(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tier_restart.json"
    argv = ["--model", str(tiny_model_dir), "--tokens", "150", "--repeats", "1", "--max-tokens", "3"]
    argv += ["--kv-mb", "1", "--returning-kv-mb", "1", "--policy-chars", "120", "--data-dir", str(data_dir)]
    assert tier_restart.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith(".venv/bin/python -m bench.tier_restart --model")
    assert set(report["summary"]) == {"restart", "returning"}
    for summary in report["summary"].values():
        assert {"warm_ttft_s_median", "cold_ttft_s_median", "ratio_median", "outputs_identical"} <= set(summary)
        assert {"disk_tokens_median", "memory_tokens_median", "meets_target", "rounds"} <= set(summary)
    assert [r["scenario"] for r in report["rounds"]] == ["restart", "returning"]
    assert {"cpu", "cpu_flags", "load_average_1_5_15"} <= set(report["machine"])
    assert "warm/cold" in capsys.readouterr().out


def test_tier_eviction_compares_both_policies_and_writes_json_and_plot(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "tier_eviction.json", tmp_path / "tier_eviction.png"
    argv = ["--model", str(tiny_model_dir), "--kv-mb", "1", "--sessions", "3", "--turns", "2", "--active", "2"]
    argv += ["--max-tokens", "2", "--policy-chars", "120", "--data-dir", str(data_dir)]
    assert tier_eviction.main([*argv, "--out", str(out), "--png", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith(".venv/bin/python -m bench.tier_eviction --model")
    assert [r["label"] for r in report["runs"]] == ["lru", "weighted"]
    for run in report["runs"]:
        assert {"hit_rate", "hit_rate_memory", "hit_rate_disk", "mean_ttft_s", "hit_rate_after_prefix"} <= set(run)
    assert report["replay"]["turns"] == 6
    (only,) = report["verdicts"]
    assert only["tiers"] == "memory only" and only["winner"] in ("lru", "weighted")
    assert set(report["outputs"]["turns_differing"]) == {"weighted"}
    assert png.stat().st_size > 0
    assert "wins" in capsys.readouterr().out
