"""``bench.start_time`` end to end at the tiniest scale (a tiny GGUF, one round, no C kernels), so it cannot rot. No
performance assertions: only that both starts run, the first converts and the later one does not, and the report has
its keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import start_time
from engine.testing import build_tiny_gguf
from support.server import free_port


def test_phase_durations_last_until_the_next_phase() -> None:
    phases = [
        (0.0, "migrating the database"),
        (0.5, "loading the model x.gguf"),
        (0.6, "converting it to a safetensors cache, once (30 s or more on 2 cores)"),
        (30.6, "loading the converted model"),
        (40.1, "marking replies a crash cut off, pinning prefixes"),
        (40.4, "kvchat ready: ..."),
    ]
    converting, loading = start_time.phase_durations(phases)
    assert (round(converting, 6), round(loading, 6)) == (30.0, 9.6)


def test_start_time_runs_a_first_and_a_later_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCHAT_DISABLE_KERNELS", "1")
    gguf = build_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "start_time.json"
    argv = ["--model", str(gguf), "--repeats", "1", "--port", str(free_port()), "--timeout", "300", "--out", str(out)]
    assert start_time.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"name", "command", "machine", "model", "median", "rounds"}
    (first_and_later,) = report["rounds"]
    first, later = first_and_later["first"], first_and_later["later"]
    assert first["converting_s"] > 0 and later["converting_s"] == 0
    assert [text for _, text in later["phases"]][-1].startswith("kvchat ready: ")
    assert 0 < first["listening_s"] <= first["ready_s"]
    assert "start" in capsys.readouterr().out
