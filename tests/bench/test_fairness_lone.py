"""``bench.fairness_lone`` without servers: the alternating order, and the fair / FCFS ratio over the windows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.fairness_lone import build_parser, cpu_s, round_order, totals
from bench.hardening import Server


def test_the_builds_alternate_which_goes_first() -> None:
    assert [round_order(r) for r in range(3)] == [("fair", "fcfs"), ("fcfs", "fair"), ("fair", "fcfs")]


def test_the_ratio_is_over_every_window_of_each_build() -> None:
    windows = [
        {"build": "fair", "tokens": 300, "completion": 100},
        {"build": "fcfs", "tokens": 400, "completion": 160},
        {"build": "fcfs", "tokens": 200, "completion": 40},
        {"build": "fair", "tokens": 270, "completion": 100},
    ]
    out = totals(windows, 10.0)
    assert (out["fair"]["tokens_per_s"], out["fcfs"]["tokens_per_s"]) == (28.5, 30.0)
    assert out["fair_over_fcfs"] == out["fair_over_fcfs_tokens_per_s"] == 0.95
    assert (out["fair"]["completion_per_s"], out["fair_over_fcfs_completion_per_s"]) == (10.0, 1.0)
    assert totals([], 10.0)["fair_over_fcfs"] is None


def test_the_idle_server_cpu_time_is_read_from_proc(tmp_path: Path) -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    busy += "print('spun', flush=True)\ninput()\n"
    proc = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"spun\n"
        assert 0.3 <= cpu_s(Server(proc, 0, tmp_path / "log")) < 30
    finally:
        proc.communicate(b"\n", timeout=30)
    assert (
        build_parser().parse_args(["--database-url", "a", "--fcfs-database-url", "b", "--fcfs-repo", "."]).rounds == 3
    )
