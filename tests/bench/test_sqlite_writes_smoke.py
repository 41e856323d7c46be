"""``bench.sqlite_writes`` runs end to end on a few writers and writes its JSON (both variants, every transaction)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import sqlite_writes


def test_the_store_step_benchmark_times_both_variants(tmp_path: Path) -> None:
    out = tmp_path / "writes.json"
    args = ["--writers", "4", "--turns", "3", "--think-ms", "1", "--rounds", "2", "--out", str(out)]
    assert sqlite_writes.main(args) == 0
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"file lock", "queued"}
    assert [r["n"] for r in record["results"].values()] == [4 * 3 * 2, 4 * 3 * 2]
    assert record["command"] == "python -m bench.sqlite_writes " + " ".join(args)
