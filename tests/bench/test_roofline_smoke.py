"""``bench.roofline`` end to end at the tiniest scale (the tiny model, ``--quick`` sizes), so it cannot rot. No
performance assertions: only that it runs and writes its table, JSON, plot and markdown section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import roofline
from engine.device import cpu_kind


def test_roofline_measures_limits_and_phases_and_writes_its_section(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png, md = tmp_path / "roofline.json", tmp_path / "roofline.png", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nkept\n")
    argv = ["--quick", "--model", str(tiny_model_dir), "--repeats", "1", "--dtypes", "bfloat16,float32"]
    assert roofline.main([*argv, "--json", str(out), "--png", str(png), "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    skip_bf16 = roofline.not_measured(torch.bfloat16)  # (AVX2 kinds: said in the report, not measured)
    assert report["not_measured"] == ({} if skip_bf16 is None else {"bfloat16": skip_bf16})
    assert set(report["phases"]) == ({"float32"} if skip_bf16 else {"bfloat16", "float32"})
    assert report["command"].startswith(".venv/bin/python -m bench.roofline --quick")
    assert {"cpu_kind", "cpu_description", "git_commit"} <= set(report["machine"])
    assert all(lim["bandwidth_gbs"] > 0 and lim["peak_gflops"] > 0 for lim in report["limits"])
    keys = [p["key"] for p in report["phases"]["float32"]]
    assert keys == ["decode_1", "decode_16", "attention_16x128", "attention_1x128", "prefill_32", "prefill_64"]
    assert all(p["fraction"] > 0 and p["bound"] in ("memory", "compute") for p in report["phases"]["float32"])
    assert png.stat().st_size > 0
    text = md.read_text()
    begin, end = roofline.markers(cpu_kind())
    assert skip_bf16 is None or skip_bf16 in text
    assert "kept" in text and begin in text and end in text and "furthest from its limit" in text
    assert "furthest from its limit" in capsys.readouterr().out


def test_a_second_kind_gets_its_own_section_and_the_first_is_kept() -> None:
    from bench.run_all import replace_block

    text = "# Benchmarks\n"
    for kind in ("AVX2 + FMA", "AMX", "AVX2 + FMA"):
        text = replace_block(text, *roofline.markers(kind), f"figures of {kind}")
    assert text.count("figures of AVX2 + FMA") == 1 and text.count("figures of AMX") == 1
    assert roofline.slug("AVX-512 + AVX512-BF16") == "avx-512-avx512-bf16"


def test_bf16_is_measured_only_where_the_cpu_multiplies_it_natively() -> None:
    avx2, zen4 = frozenset({"avx2", "fma"}), frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    reason = roofline.not_measured(torch.bfloat16, avx2)
    assert reason is not None and "AVX2 + FMA" in reason and "fp32" in reason
    assert roofline.not_measured(torch.bfloat16, zen4) is None
    assert roofline.not_measured(torch.float32, avx2) is None
