"""``bench.step_mix`` end to end at the tiniest scale (the tiny model), so it cannot rot. No performance assertions:
only that it runs every mix and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import step_mix


def test_step_mix_times_every_mix_and_writes_its_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "step_mix.json"
    argv = ["--model", str(tiny_model_dir), "--context", "16", "--prefill-rows", "4,8", "--decodes", "1,3"]
    assert step_mix.main([*argv, "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["decode_rows"], r["prefill_rows"]) for r in rows] == [(0, 4), (0, 8), (1, 0), (3, 0), (2, 4), (2, 8)]
    assert all(r["ms_median"] > 0 for r in rows)
