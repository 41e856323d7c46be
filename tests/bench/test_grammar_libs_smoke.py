"""bench/grammar_libs.py on the tiny model's tokenizer with llguidance (kvchat's dependency): every case walks a valid
document through the masks, and a library that is not installed is reported, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

from bench import grammar_libs


def test_llguidance_is_measured_on_every_schema(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gl.json"
    argv = ["--model", str(tiny_model_dir), "--repeats", "1", "--libraries", "llguidance", "--out", str(out)]
    assert grammar_libs.main(argv) == 0
    result = json.loads(out.read_text())
    [library] = result["results"]
    assert library["library"] == "llguidance"
    assert [c["schema"] for c in library["cases"]] == list(grammar_libs.CASES)
    assert all(c["accepted"] and c["tokens"] > 5 and c["mask_us_median"] > 0 for c in library["cases"])
    assert library["install_mb"] > 0
