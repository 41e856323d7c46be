"""One JSON line per engine step (``EngineConfig.step_trace``): when its forward pass began, how long it took, and
what the step held per tenant (sequences, prefill tokens, decode rows, draft rows), with the running and waiting
sequences per tenant after it was planned.

NOTE: why: a reply's latency under load is a question of which steps it waited behind, and the histograms in
``/metrics`` cannot say that. Issue 42's probe (tenant B's first turn beside tenant A's 60 new sessions) found it here:
B's prompt waited behind steps that ran up to 30x slower than the same mix on a quiet machine, while the backend handled
A's turns on the same two cores. Off by default: a line a step is ~200 bytes (~25 steps/s at full decode).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.scheduler import ScheduledSeq, decodes
from engine.sequence import Sequence


def _tally(seqs: Iterable[Sequence]) -> dict[str, int]:
    return dict(Counter(s.share.tenant for s in seqs))


def step_record(
    began: float,
    seconds: float,
    scheduled: Iterable[ScheduledSeq],
    running: Iterable[Sequence],
    waiting: Iterable[Sequence],
    threads: int | None = None,
) -> dict[str, Any]:
    """The line of one step, read before the step's tokens are appended: ``tenants`` maps each tenant in the step to
    ``[sequences, prefill tokens, decode rows, draft rows]``; ``running`` and ``waiting`` count sequences per tenant;
    ``threads``: the step's OpenMP width where it adapts (``engine.cpu_share``)."""
    tenants: dict[str, list[int]] = {}
    for item in scheduled:
        seq = item.seq
        row = tenants.setdefault(seq.share.tenant, [0, 0, 0, 0])
        row[0] += 1
        if decodes(seq):  # (its last sampled token, and drafts; read before update_after_step)
            row[2] += 1
            row[3] += len(item.drafts)
        else:  # a prompt's chunk, or a preempted sequence's recompute
            row[1] += item.num_new_tokens
    record: dict[str, Any] = {
        "t": round(began, 4),
        "ms": round(1000 * seconds, 2),
        "tenants": tenants,
        "running": _tally(running),
        "waiting": _tally(waiting),
    }
    if threads is not None:
        record["threads"] = threads
    return record


class StepTrace:
    """Appends ``step_record`` lines to ``path`` (created with its folder; line-buffered, so a crash loses at most the
    step in flight)."""

    def __init__(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = target.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
