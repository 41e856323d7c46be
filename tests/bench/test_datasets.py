"""The vendored benchmark data: found inside the repository, read plain or xz-compressed."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from bench import datasets

REPO = Path(__file__).resolve().parents[2]


def test_the_data_lives_in_the_repository_and_parses() -> None:
    assert datasets.DATA_DIR == REPO / "bench" / "data"
    lines = datasets.read_text(datasets.CONVERSATIONS).splitlines()
    assert len(lines) == 2000
    assert {"id", "turns"} <= set(json.loads(lines[0]))
    assert isinstance(json.loads(datasets.read_text(datasets.GUIDELINES)), dict)
    assert "CuCom" in (datasets.DATA_DIR / "README.md").read_text()  # the attribution travels with the files


def test_a_plain_copy_wins_over_the_compressed_one(tmp_path: Path) -> None:
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(b"packed"))
    assert datasets.read_text(tmp_path / "a.txt") == "packed"
    (tmp_path / "a.txt").write_text("plain")
    assert datasets.read_text(tmp_path / "a.txt") == "plain"


def test_a_missing_file_names_both_candidates(tmp_path: Path) -> None:
    with pytest.raises(datasets.DataNotFoundError, match=r"b\.txt not found \(nor b\.txt\.xz\)"):
        datasets.read_text(tmp_path / "b.txt")


def test_nothing_in_the_repository_reads_a_folder_beside_it() -> None:
    needle = "/".join(("..", "shared"))  # (built, so this file does not match itself)
    hits = [
        str(p.relative_to(REPO))
        for top in ("backend", "engine", "bench", "tests", "docs", "migrations", "frontend_stub")
        for p in (REPO / top).rglob("*")
        if p.is_file() and p.suffix in {".py", ".md", ".json", ".toml", ".sh", ".html"} and needle in p.read_text()
    ]
    assert hits == []
