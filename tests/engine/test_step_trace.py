"""The step trace (``engine/step_trace.py``): what each step held per tenant, on integers and through a real engine."""

from __future__ import annotations

import json
from pathlib import Path

from engine.fair_share import FairShare
from engine.kv.block_hash import root_hash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request_table import Collector
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.step_trace import StepTrace, step_record
from support.engines import make_engine

ROOT = root_hash("m", "ns")


def seq(rid: str, tenant: str, start: int, n: int) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(), ROOT, share=FairShare(tenant))


def test_a_record_tells_prefill_chunks_from_decodes_per_tenant() -> None:
    sched = Scheduler(SchedulerConfig(2, 16, 8, 4), KVCacheManager(64, 4))
    sched.add(seq("a0", "A", 100, 10))
    sched.add(seq("a1", "A", 200, 4))
    sched.add(seq("b0", "B", 300, 5))  # the fair share admits it before a1

    out = sched.schedule()
    first = step_record(12.5, 0.25, out.scheduled, sched.running, sched.waiting)
    tenants = {"A": [1, 10, 0, 0], "B": [1, 5, 0, 0]}
    assert first == {"t": 12.5, "ms": 250.0, "tenants": tenants, "running": {"A": 1, "B": 1}, "waiting": {"A": 1}}

    sched.update_after_step(out)
    for item in out.scheduled:
        item.seq.append_token(7)
    out = sched.schedule()
    second = step_record(13.0, 0.01, out.scheduled, sched.running, sched.waiting)
    assert second["tenants"] == {"A": [1, 0, 1, 0], "B": [1, 0, 1, 0]}  # one decode row each


def test_the_trace_appends_one_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "steps.jsonl"
    trace = StepTrace(path)
    trace.write({"t": 1.0, "ms": 2.0})
    trace.write({"t": 2.0, "ms": 3.0})
    trace.close()
    trace.write({"t": 3.0})  # after close: dropped, not raised (a step racing the shutdown)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"t": 1.0, "ms": 2.0}, {"t": 2.0, "ms": 3.0}]


def test_an_engine_with_a_trace_writes_each_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    engine: LLMEngine = make_engine(tiny_model_dir, step_trace=str(path), max_num_batched_tokens=64)
    engine.load()
    collect = Collector()
    prompts = [list(range(10, 110)), list(range(200, 230))]
    shares = [FairShare("A"), FairShare("B")]
    ids = [
        engine.submit(p, SamplingParams(max_tokens=3), "default", collect, share=s)
        for p, s in zip(prompts, shares, strict=True)
    ]
    try:
        engine.run_until_idle()
    finally:
        assert engine.core.trace is not None
        engine.core.trace.close()
    assert all(r.token_ids for r in collect.results(ids))

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    prefill = {t: sum(line["tenants"].get(t, [0, 0])[1] for line in lines) for t in ("A", "B")}
    decodes = {t: sum(line["tenants"].get(t, [0, 0, 0])[2] for line in lines) for t in ("A", "B")}
    assert prefill == {"A": 100, "B": 30}  # every prompt token once, in chunks of the 64-token budget
    assert decodes == {"A": 2, "B": 2}  # the first token comes with the prompt's last chunk
    assert all(line["ms"] > 0 for line in lines)
