"""``kvchat handbook load|show`` against a real server: the file's format from its suffix, the edit summarised in one
line, errors in one ``error:`` line with exit 1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.cli import build_parser
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, LiveServer, server_settings, serving

pytestmark = pytest.mark.postgres


def main(argv: list[str]) -> int:
    """``kvchat ARGV`` without ``backend.cli.main``'s logging set-up (it would keep this test's captured stderr)."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path), tiny_engine) as server:
        yield server


def test_load_and_show_a_handbook(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "handbook.md"
    md.write_text("# Returns\nWithin 30 days.\nExamples:\n- can I send it back\n\n# Shipping\n3 to 5 days.\n")
    common = ["--url", live.http, "--admin-key", ADMIN_KEY]
    assert main(["handbook", "load", str(md), *common]) == 0
    assert capsys.readouterr().out == (
        "handbook v1: 2 sections (2 added, 0 changed, 0 removed, 0 kept); 0 cached blocks freed\n"
    )
    abcd = tmp_path / "abcd.json"
    abcd.write_text(json.dumps({"Shipping Issue": {"description": "d", "subflows": {"Cost": {"actions": []}}}}))
    assert main(["handbook", "load", str(abcd), *common]) == 0
    assert capsys.readouterr().out.startswith("handbook v2: 1 sections (1 added, 0 changed, 2 removed, 0 kept)")
    assert main(["handbook", "load", str(md), *common]) == 0
    capsys.readouterr()
    assert main(["handbook", "show", *common]) == 0
    assert capsys.readouterr().out == (
        "handbook v3: 2 sections\n"
        "  Returns  (15 characters, 1 examples, v3)\n"
        "  Shipping  (12 characters, 0 examples, v3)\n"
    )


def test_errors_are_one_line(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["handbook", "load", str(bad), "--url", live.http, "--admin-key", ADMIN_KEY]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 422: the handbook is not valid JSON") and err.count("\n") == 1
    assert main(["handbook", "show", "--url", live.http, "--admin-key", "kvc_admin_wrong"]) == 1
    assert capsys.readouterr().err.startswith("error: 401: ")
