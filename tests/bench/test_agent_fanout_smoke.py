"""``bench.agent_fanout`` end to end at the smallest scale (4 customers, 2 agents, 20 messages), so it cannot rot.
No performance assertions: only that both scenarios run, nothing is lost or duplicated, and the report is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import agent_fanout

pytestmark = pytest.mark.postgres


def test_agent_fanout_runs_both_scenarios_and_writes_its_report(
    pg_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agent_fanout.json"
    admin = pg_server.admin_dsn
    argv = ["--postgres", admin, "--customers", "4", "--agents", "2", "--messages", "20", "--out", str(out)]
    assert agent_fanout.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["scenarios"]) == {"one_worker", "two_workers"}
    for scenario in report["scenarios"].values():
        assert (scenario["messages"], scenario["received"]) == (20, 20)
        assert scenario["lost"] == scenario["duplicated"] == scenario["misrouted"] == 0
        assert 0 < scenario["fanout_ms"]["p50"] <= scenario["fanout_ms"]["p99"]
        assert scenario["end_to_end_ms"]["p50"] > 0
    assert report["command"].startswith("flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.agent_fanout")
    assert "one_worker" in capsys.readouterr().out
