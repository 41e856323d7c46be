"""``bench.load`` end to end at a tiny scale (a real ``kvchat serve`` subprocess, the tiny model), so it cannot rot.

No performance assertions (benchmarks are programs, not tests): only that every level ran, and that the refusals
happen where the capacity says they must (none at 1×; 1013 closes and ``busy`` frames at 3×).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.load import main


def test_load_program_runs_every_level_and_writes_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "load.json"
    # NOTE: 24-token replies, so the 3x level's four held sockets overlap in the engine even when the machine is slow
    # to set sockets up (with 4-token replies a loaded full-suite run once saw no busy refusal at 3x)
    argv = ["--seqs", "1", "--waiting", "1", "--levels", "1,3", "--duration", "3", "--max-tokens", "24"]
    assert main([*argv, "--think-ms", "0", "--grace", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    one, three = data["levels"]
    assert data["command"].startswith(".venv/bin/python -m bench.load --seqs 1 --waiting 1")
    assert (data["config"]["capacity"], data["config"]["tenant_cap"]) == (2, 4)
    assert [(level["multiplier"], level["clients"]) for level in data["levels"]] == [(1, 2), (3, 6)]
    assert (one["held_sockets_max"], three["held_sockets_max"]) == (2, 4)
    assert one["messages_completed"] > 0 and three["messages_completed"] > 0
    # At capacity the engine holds every message: a request arriving between a finish and the next step's admission
    # counts the freed running slot as room (it was once refused as busy: tests/engine/test_scheduler.py).
    assert (one["refused_1013"], one["refused_busy"]) == (0, 0)
    assert three["refused_1013"] > 0 and three["refused_busy"] > 0
    assert three["refused_1013_s"]["n"] == three["refused_1013"]
    assert (one["other_errors"], three["other_errors"]) == (0, 0)
    assert one["server_peak_rss_mib"] > 0
    assert "level | clients | held" in printed
    assert f"wrote {out}" in printed
