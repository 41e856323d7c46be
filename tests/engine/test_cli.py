"""``kvchat generate`` streams a completion and reports what the cache did; bad input is one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_generate_streams_and_repeats_with_a_prefix_hit(tiny_model_dir: Path) -> None:
    result = _generate(
        "Where is my order?", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "5", "--repeat", "2"
    )
    assert result.returncode == 0, result.stderr
    reports = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(reports) == 2
    assert "[length] prompt " in reports[0]
    assert "(0 cached" in reports[0]
    assert "(0 cached" not in reports[1]  # the second run reuses the first run's blocks


def test_generate_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    result = _generate("hi", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr
    bad = _generate("hi", "--model", "smollm2", "--max-tokens", "0")
    assert bad.returncode == 2
    assert "max_tokens" in bad.stderr
    assert "Traceback" not in bad.stderr
