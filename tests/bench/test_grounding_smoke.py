"""bench/grounding.py on the tiny model: every condition is built and scored, the whole handbook is reported as over
the context, the section choice is judged per split, and the guard leaves no invented contact."""

from __future__ import annotations

import json
from pathlib import Path

from backend.context.contact_guard import guarded
from backend.context.grounding import Grounding
from bench import grounding
from bench.datasets import read_text


def test_one_session_under_every_condition(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert grounding.REQUESTS.is_relative_to(grounding.REPO / "bench" / "data")  # vendored, in the repository
    lines = read_text(grounding.REQUESTS).splitlines()
    requests = tmp_path / "requests.jsonl"
    dev = [ln for ln in lines if '"dev"' in ln][:3]
    requests.write_text("\n".join([*dev, *[ln for ln in lines if '"held_out"' in ln][:2]]) + "\n")
    out = tmp_path / "g.json"
    argv = ["--model", str(tiny_model_dir), "--sessions", "1", "--turns", "1", "--max-tokens", "4"]
    assert grounding.main([*argv, "--requests", str(requests), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    conditions = result["conditions"]
    assert list(conditions) == ["none", "excerpt", "sections", "whole"]
    assert conditions["whole"]["over_context"] == 1 and conditions["whole"]["nll_mean"] is None
    for name in ("none", "sections"):
        assert conditions[name]["turns"] == 1 and conditions[name]["nll_mean"] > 0
        assert conditions[name]["invented_guard_on"] == 0.0
    assert conditions["none"]["prompt_tokens_mean"] < conditions["sections"]["prompt_tokens_mean"]
    methods = result["section_choice"]["methods"]
    for name in ("bm25 + head vectors + examples", "+ group classifier (the default)"):
        assert (methods[name]["dev"]["requests"], methods[name]["held_out"]["requests"]) == (3, 2)
    cost = result["section_choice"]["cost"]
    assert cost["rank_ms"] > 0 and cost["selection_turns"] == 1 and cost["selection_ms_max"] > 0


def test_an_invented_contact_is_counted_and_the_guard_removes_it() -> None:
    sources = Grounding(("Call us at 555-010-9999.", "My order is 302-1234567."))
    assert not grounding.invents("Call 555-010-9999 about order 302-1234567.", sources)
    invented = "Visit www.shop-help-now.com or call 1082567394."
    assert grounding.invents(invented, sources)
    assert not grounding.invents(guarded(invented, sources), sources)
