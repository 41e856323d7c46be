"""Keeps the benchmark programs from rotting: every code path runs on the tiny model in --quick mode (seconds).

Performance is never asserted here: only that each program runs, measures every target and writes its outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import engine_bench, run_all
from bench.reporting import Summary, TargetResult, format_table

TARGET_KEYS = {
    "followup_ttft_vs_hf",
    "followup_ttft_vs_bare_forward",
    "cold_prefill_vs_hf",
    "decode_vs_hf_generate",
    "decode_int8_vs_hf_generate",
    "concurrent_short_vs_single",
    "concurrent_long_vs_single",
    "kv_bytes_per_token_vs_theory",
    "shared_prefix_copies",
}


def _quick_argv(model: Path) -> list[str]:
    return ["--quick", "--model", str(model), "--dtype", "float32", "--kv-mb", "8"]


def test_run_all_quick_writes_json_png_and_the_engine_section(tiny_model_dir: Path, tmp_path: Path) -> None:
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Benchmarks\n\nhand-written intro\n\n## Workload\n\nkept as is\n")
    out = tmp_path / "benchmarks"

    assert run_all.main([*_quick_argv(tiny_model_dir), "--out-dir", str(out), "--markdown", str(markdown)]) == 0

    data = json.loads((out / "engine.json").read_text())
    assert {t["key"] for t in data["targets"]} == TARGET_KEYS
    assert all(t["ratio"] > 0 for t in data["targets"])
    assert set(data["sections"]) == set(engine_bench.SECTIONS)
    assert data["errors"] == {}
    assert data["machine"]["dtype"] == "float32"
    assert data["machine"]["torch_threads"] == 2
    assert data["command"].startswith(".venv/bin/python -m bench.engine_bench --quick")
    # the engine path really reused the cache: the history is a hit, only the new tokens are computed
    followup = data["sections"]["followup"]
    assert followup["engine_cached_tokens"] == [followup["history_tokens"]]
    assert followup["engine_prefilled_tokens"] == [followup["new_tokens"]]
    assert data["sections"]["prefill"]["engine_cached_tokens"] == [0]
    kv = data["sections"]["kv"]
    block_size = kv["block_size"]
    assert kv["cached_tokens_per_request_shared"] == [kv["prefix_tokens"] // block_size * block_size]
    # NOTE: peaks are polled from another thread, so only their order is certain, not their exact values
    assert 0 < kv["peak_used_blocks_shared"] <= kv["expected_blocks_shared"]
    assert kv["peak_used_blocks_shared"] < kv["peak_used_blocks_unshared"] <= kv["expected_blocks_unshared"]
    assert (out / "engine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    text = markdown.read_text()
    assert "hand-written intro" in text
    assert "## Workload\n\nkept as is" in text
    assert text.count(run_all.ENGINE_BEGIN) == 1
    assert "| workload | skipped |" in text
    assert "benchmarks/engine.json" in text

    # a second run replaces the generated blocks instead of appending new ones
    run_all.write_markdown(markdown, "## Engine\n\nsecond", "## Last run\n\nsecond")
    text = markdown.read_text()
    assert text.count(run_all.ENGINE_BEGIN) == 1
    assert text.count(run_all.RUN_BEGIN) == 1
    assert "## Engine\n\nsecond" in text


def test_bench_engine_main_runs_one_section(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_quick_argv(tiny_model_dir), "kv", "--json", str(tmp_path / "e.json"), "--png", str(tmp_path / "e.png")]

    assert engine_bench.main(argv) == 0

    printed = capsys.readouterr().out
    assert "reproduce: .venv/bin/python -m bench.engine_bench --quick" in printed
    data = json.loads((tmp_path / "e.json").read_text())
    assert {t["key"] for t in data["targets"]} == {"kv_bytes_per_token_vs_theory", "shared_prefix_copies"}
    assert data["sections"]["kv"]["measured_bytes_per_token"] == data["sections"]["kv"]["theoretical_bytes_per_token"]


def test_unknown_section_is_a_usage_error(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        engine_bench.run([*_quick_argv(tiny_model_dir), "nonsense"])


def test_workload_missing_or_skipped_is_reported_not_raised() -> None:
    outcome = run_all.run_workload(quick=False, skip=True)
    assert (outcome.name, outcome.status) == ("workload", "skipped")


def test_report_helpers() -> None:
    s = Summary.of([3.0, 1.0, 2.0])
    assert (s.median, s.mean, s.min, s.max, s.n) == (2.0, 2.0, 1.0, 3.0, 3)
    below = TargetResult("k", "t", 0.5, "<=", 0.7, "1 ms", "2 ms")
    above = TargetResult("k", "t", 1.5, ">=", 2.0, "1", "2")
    assert below.met
    assert not above.met
    assert below.margin == pytest.approx(1.4)
    table = format_table(["a", "b"], [["x", 1.5], ["yy", 20.0]])
    assert table.splitlines()[0].startswith("a")
    assert len(table.splitlines()) == 4
    assert run_all.replace_block("intro\n", "<b>", "<e>", "body") == "intro\n\n<b>\nbody\n<e>\n"


def test_a_failing_section_is_reported_and_the_others_still_count(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: engine_bench.Bench) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine_bench.Bench, "kv", boom)
    json_path, png_path = tmp_path / "e.json", tmp_path / "e.png"
    argv = [*_quick_argv(tiny_model_dir), "prefill", "kv", "--json", str(json_path), "--png", str(png_path)]
    assert engine_bench.main(argv) == 1
    data = json.loads(json_path.read_text())
    assert data["errors"] == {"kv": "RuntimeError: boom"}
    assert [t["key"] for t in data["targets"]] == ["cold_prefill_vs_hf"]
