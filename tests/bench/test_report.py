"""The workload report's targets against vLLM (issue 33): each ratio from its own statistic, each goal judged."""

from __future__ import annotations

from bench.driver import SystemResult
from bench.metrics import LevelSummary, Stat
from bench.report import compute_targets, vllm_targets


def _level(concurrency: int, ttft_mean: float, ttft_p99: float, itl_mean: float, tok_s: float) -> LevelSummary:
    return LevelSummary(
        concurrency=concurrency,
        sessions=concurrency,
        turns_planned=6,
        turns_done=6,
        errors=0,
        first_error=None,
        timed_out=False,
        wall_s=10.0,
        ttft_s=Stat(ttft_mean, ttft_mean, ttft_p99, 6),
        itl_s=Stat(itl_mean, itl_mean, itl_mean, 6),
        output_tokens=int(tok_s * 10),
        throughput_tok_s=tok_s,
        prompt_tokens=6000,
        cached_tokens=5000,
        hit_rate=5000 / 6000,
        ttft_by_turn_s={1: ttft_mean, 2: ttft_mean},
        ttft_by_turn_n={1: 1, 2: 1},
        hit_rate_by_turn={1: 0.0, 2: 0.9},
        kv_peak_bytes=None,
    )


def _system(name: str, levels: list[LevelSummary]) -> SystemResult:
    return SystemResult(name, name, "ok", levels=levels)


def test_each_vllm_ratio_is_judged_against_its_goal() -> None:
    results = {
        "kvchat": _system("kvchat", [_level(1, 0.2, 0.5, 0.017, 40), _level(16, 0.3, 0.9, 0.07, 150)]),
        "vllm": _system("vllm", [_level(1, 0.3, 0.9, 0.022, 32), _level(16, 0.32, 0.64, 0.13, 100)]),
    }
    by_name = {t.name: t for t in vllm_targets(results, 16, 1)}
    mean = by_name["16 sessions: mean TTFT kvchat / vllm"]
    assert mean.value is not None and abs(mean.value - 0.3 / 0.32) < 1e-9 and mean.met is False
    p99 = by_name["16 sessions: p99 TTFT kvchat / vllm"]
    assert p99.value is not None and abs(p99.value - 0.9 / 0.64) < 1e-9 and p99.met is False
    tput = by_name["16 sessions: throughput kvchat / vllm"]
    assert tput.value == 1.5 and tput.met is True
    itl = by_name["1 session(s): mean ITL kvchat / vllm"]
    assert itl.value is not None and abs(itl.value - 0.017 / 0.022) < 1e-9 and itl.met is True
    assert set(by_name) <= {t.name for t in compute_targets(results, 16, 1)}


def test_without_vllm_the_targets_are_not_measured() -> None:
    results = {"kvchat": _system("kvchat", [_level(1, 0.2, 0.5, 0.017, 40), _level(16, 0.3, 0.9, 0.07, 150)])}
    assert all(t.value is None and t.met is None for t in vllm_targets(results, 16, 1))
