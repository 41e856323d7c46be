"""Per-turn records → per-level summaries: TTFT, inter-token latency, throughput, prefix-token hit rate, memory.

Definitions (the same for every system):

* TTFT: the driver's clock, from handing the turn to the system to the arrival of its first token (queueing in a
  system that serves one request at a time is part of it, as a customer would feel it).
* ITL: per turn, (last token − first token) / (tokens − 1); summarised over turns.
* throughput: output tokens of the level / the level's wall time (first turn sent → last token received).
* prefix-token hit rate: prompt tokens the system reused from its cache / prompt tokens, over all turns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TurnRecord:
    session_id: str
    turn_index: int
    submitted_s: float  # run clock
    token_times_s: tuple[float, ...]  # run clock, one entry per arrival (a chunk may carry several tokens)
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.submitted_s if self.token_times_s else None

    @property
    def itl_s(self) -> float | None:
        if self.output_tokens < 2 or len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def finished_s(self) -> float:
        return self.token_times_s[-1] if self.token_times_s else self.submitted_s


@dataclass(frozen=True, slots=True)
class Stat:
    mean: float | None
    p50: float | None
    p99: float | None
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        if not samples:
            return cls(None, None, None, 0)
        ordered = sorted(samples)
        return cls(sum(ordered) / len(ordered), percentile(ordered, 50), percentile(ordered, 99), len(ordered))


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on already sorted samples."""
    if not ordered:
        raise ValueError("percentile of no samples")
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class LevelSummary:
    concurrency: int
    sessions: int
    turns_planned: int
    turns_done: int
    errors: int
    first_error: str | None
    timed_out: bool  # the level's time box ended it before every turn was sent
    wall_s: float
    ttft_s: Stat
    itl_s: Stat
    output_tokens: int
    throughput_tok_s: float
    prompt_tokens: int
    cached_tokens: int | None
    hit_rate: float | None
    ttft_by_turn_s: dict[int, float]  # turn index → mean TTFT
    ttft_by_turn_n: dict[int, int]
    hit_rate_by_turn: dict[int, float | None]  # turn index → reused / prompt tokens over that turn's requests
    kv_peak_bytes: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LevelSummary:
        values = dict(data)
        values["ttft_s"] = Stat(**values["ttft_s"])
        values["itl_s"] = Stat(**values["itl_s"])
        values["ttft_by_turn_s"] = {int(k): v for k, v in values["ttft_by_turn_s"].items()}
        values["ttft_by_turn_n"] = {int(k): v for k, v in values["ttft_by_turn_n"].items()}
        values["hit_rate_by_turn"] = {int(k): v for k, v in values["hit_rate_by_turn"].items()}
        return cls(**values)


def summarize(
    records: Sequence[TurnRecord],
    concurrency: int,
    sessions: int,
    turns_planned: int,
    timed_out: bool,
    kv_peak_bytes: int | None,
) -> LevelSummary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [v for v in (r.itl_s for r in ok) if v is not None]
    start = min((r.submitted_s for r in records), default=0.0)
    end = max((r.finished_s for r in records), default=0.0)
    wall = max(end - start, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    known = [r.cached_tokens for r in ok]
    cached = None if not ok or any(c is None for c in known) else sum(c for c in known if c is not None)
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft_s is not None:
            by_turn.setdefault(r.turn_index, []).append(r.ttft_s)
    hits: dict[int, float | None] = {}
    for t in sorted({r.turn_index for r in ok}):
        turn = [r for r in ok if r.turn_index == t]
        reused = [r.cached_tokens for r in turn]
        total = sum(r.prompt_tokens for r in turn)
        hits[t] = None if any(c is None for c in reused) or not total else sum(c or 0 for c in reused) / total
    return LevelSummary(
        concurrency=concurrency,
        sessions=sessions,
        turns_planned=turns_planned,
        turns_done=len(ok),
        errors=len(failed),
        first_error=failed[0].error if failed else None,
        timed_out=timed_out,
        wall_s=wall if records else 0.0,
        ttft_s=Stat.of(ttfts),
        itl_s=Stat.of(itls),
        output_tokens=out_tokens,
        throughput_tok_s=out_tokens / wall if records else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if cached is not None and prompt else None,
        ttft_by_turn_s={t: sum(v) / len(v) for t, v in sorted(by_turn.items())},
        ttft_by_turn_n={t: len(v) for t, v in sorted(by_turn.items())},
        hit_rate_by_turn=hits,
        kv_peak_bytes=kv_peak_bytes,
    )


def ttft_growth(summary: LevelSummary, first: int = 2, last: int = 12) -> float | None:
    """Relative TTFT growth from turn ``first`` to turn ``last`` (0.5 = +50%); None when either is missing."""
    a, b = summary.ttft_by_turn_s.get(first), summary.ttft_by_turn_s.get(last)
    if a is None or b is None or a <= 0:
        return None
    return b / a - 1


def matched_mean_ttft(a: LevelSummary, b: LevelSummary) -> tuple[float, float] | None:
    """Mean TTFT of two systems over the turn indices both completed, weighted like ``a``.

    NOTE: a slow system's time box may end before its late (long-history) turns run; comparing plain means would
    then flatter it, so ratios are taken over the turns both systems served.
    """
    common = [t for t in a.ttft_by_turn_s if t in b.ttft_by_turn_s]
    if not common:
        return None
    weight = sum(a.ttft_by_turn_n[t] for t in common)
    mean_a = sum(a.ttft_by_turn_s[t] * a.ttft_by_turn_n[t] for t in common) / weight
    mean_b = sum(b.ttft_by_turn_s[t] * a.ttft_by_turn_n[t] for t in common) / weight
    return mean_a, mean_b
