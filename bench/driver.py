"""Replay the workload against one system: every concurrency level in turn, each time-boxed; one JSON result.

Run by ``bench.run`` as its own process per system (``python -m bench.driver --spec SPEC --out OUT``), so that one
system's memory, threads and crashes never touch another's numbers. Progress goes to stdout as JSON lines
(``{"progress": ...}``); the result goes to ``OUT``.

Within a level every session is a closed loop: it arrives (the workload's arrival offset), sends turn 1, waits for
the whole reply, thinks, sends turn 2, ... When the level's time box ends no new turn is sent; turns in flight finish
(up to a grace period, after which they are abandoned and the level is marked timed out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import LevelSummary, TurnRecord, summarize
from bench.runners import SYSTEMS, SystemOptions, make_runner, model_folder
from bench.runners.base import Runner, RunnerUnavailable, TurnRequest
from bench.workload import Arrival, Session, ThinkTime, WorkloadConfig, build_sessions

_MAX_CONSECUTIVE_ERRORS = 3
_KV_SAMPLE_S = 0.2


@dataclass(frozen=True, slots=True)
class DriverSpec:
    system: str
    options: SystemOptions
    workload: WorkloadConfig
    levels: tuple[int, ...]
    level_budgets_s: tuple[float, ...]  # per level: no new turn is sent after this
    grace_s: float  # turns in flight may finish within this much more

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["options"]["log_dir"] = str(self.options.log_dir)
        data["workload"]["data_dir"] = str(self.workload.data_dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DriverSpec:
        options = dict(data["options"])
        options["log_dir"] = Path(options["log_dir"])
        workload = dict(data["workload"])
        workload["data_dir"] = Path(workload["data_dir"])
        workload["think"] = ThinkTime(workload["think"])
        workload["arrival"] = Arrival(workload["arrival"])
        return cls(
            system=data["system"],
            options=SystemOptions(**options),
            workload=WorkloadConfig(**workload),
            levels=tuple(data["levels"]),
            level_budgets_s=tuple(float(b) for b in data["level_budgets_s"]),
            grace_s=float(data["grace_s"]),
        )


@dataclass(slots=True)
class SystemResult:
    system: str
    description: str
    status: str  # "ok", "unavailable", "failed"
    error: str | None = None
    version: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    startup_s: float | None = None
    levels: list[LevelSummary] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    kv_capacity_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["levels"] = [level.to_json() for level in self.levels]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SystemResult:
        values = dict(data)
        values["levels"] = [LevelSummary.from_json(level) for level in values.get("levels", [])]
        return cls(**values)


Progress = Callable[[dict[str, Any]], None]


def _print_progress(event: dict[str, Any]) -> None:
    print(json.dumps({"progress": event}), flush=True)


async def run_system(spec: DriverSpec, progress: Progress = _print_progress) -> SystemResult:
    result = SystemResult(spec.system, SYSTEMS.get(spec.system, spec.system), "ok")
    try:
        runner = make_runner(spec.system, spec.options)
    except RunnerUnavailable as exc:
        result.status, result.error = "unavailable", str(exc)
        return result
    started = time.perf_counter()
    try:
        info = await runner.start()
    except Exception as exc:  # noqa: BLE001 - a peer that cannot start is reported with its error, never skipped
        result.status, result.error = "unavailable", f"failed to start: {type(exc).__name__}: {exc}"
        await _close_quietly(runner)
        return result
    result.startup_s = time.perf_counter() - started
    result.version, result.details = info.version, info.details
    progress({"started": spec.system, "startup_s": round(result.startup_s, 1)})
    try:
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_folder(spec.options.model))
        await _warm_up(runner, tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}]))
        offset = 0
        for concurrency, budget_s in zip(spec.levels, spec.level_budgets_s, strict=True):
            sessions = build_sessions(spec.workload, concurrency, start=offset)
            offset += concurrency
            prompts = {
                (s.session_id, t.index): tokenizer.apply_chat_template(s.messages(t.index))
                for s in sessions
                for t in s.turns
            }
            level = await run_level(runner, sessions, prompts, spec, concurrency, budget_s, progress)
            result.levels.append(level)
            progress({"level_done": concurrency, "turns": level.turns_done, "timed_out": level.timed_out})
        result.kv_capacity_bytes = runner.kv_capacity_bytes()
    except Exception as exc:  # noqa: BLE001 - recorded in the result; the other systems still run
        traceback.print_exc()
        result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
    await _close_quietly(runner)
    result.peak_rss_bytes = runner.peak_rss_bytes()
    return result


async def _close_quietly(runner: Runner) -> None:
    try:
        await runner.close()
    except Exception:  # noqa: BLE001 - closing must not hide the result
        traceback.print_exc()


async def _warm_up(runner: Runner, prompt_ids: list[int]) -> None:
    """One short request first, so lazy initialisation is not billed to the first measured turn."""
    request = TurnRequest("warmup", "warmup", 1, [{"role": "user", "content": "Hello!"}], prompt_ids, 4)
    await runner.run_turn(request, lambda n: None)
    await runner.end_session("warmup")


async def run_level(
    runner: Runner,
    sessions: Sequence[Session],
    prompts: dict[tuple[str, int], list[int]],
    spec: DriverSpec,
    concurrency: int,
    budget_s: float,
    progress: Progress,
) -> LevelSummary:
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    records: list[TurnRecord] = []
    stopped_early = False
    kv_peak: int | None = None

    def now() -> float:
        return time.perf_counter() - t0

    async def play(session: Session) -> None:
        nonlocal stopped_early, kv_peak
        await asyncio.sleep(session.start_s)
        errors = 0
        for turn in session.turns:
            await asyncio.sleep(session.think_s[turn.index - 1])
            if time.perf_counter() > deadline:
                stopped_early = True
                break
            request = TurnRequest(
                session.session_id,
                session.tenant,
                turn.index,
                session.messages(turn.index),
                prompts[(session.session_id, turn.index)],
                spec.options.max_tokens,
            )
            times: list[float] = []

            def stamp(n: int, sink: list[float] = times) -> None:
                sink.append(now())

            submitted = now()
            try:
                outcome = await runner.run_turn(request, stamp)
                if outcome.kv_bytes is not None:
                    kv_peak = max(kv_peak or 0, outcome.kv_bytes)
                record = TurnRecord(
                    session.session_id,
                    turn.index,
                    submitted,
                    tuple(times),
                    outcome.output_tokens,
                    outcome.prompt_tokens,
                    outcome.cached_tokens,
                )
                errors = 0
            except Exception as exc:  # noqa: BLE001 - a failed turn is recorded and counted, not fatal
                record = TurnRecord(
                    session.session_id, turn.index, submitted, tuple(times), 0, len(request.prompt_ids), None, str(exc)
                )
                errors += 1
            records.append(record)
            progress({"turn": turn.index, "session": session.session_id, "ok": record.ok})
            if errors >= _MAX_CONSECUTIVE_ERRORS or "handed the session to a human" in (record.error or ""):
                break
        await runner.end_session(session.session_id)

    async def sample_kv() -> None:
        nonlocal kv_peak
        while True:
            value = runner.kv_bytes()
            if value is not None:
                kv_peak = max(kv_peak or 0, value)
            await asyncio.sleep(_KV_SAMPLE_S)

    sampler = asyncio.create_task(sample_kv())
    tasks = [asyncio.create_task(play(s)) for s in sessions]
    done, pending = await asyncio.wait(tasks, timeout=budget_s + spec.grace_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    planned = sum(len(s.turns) for s in sessions)
    return summarize(records, concurrency, len(sessions), planned, stopped_early or bool(pending), kv_peak)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.driver", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = DriverSpec.from_json(json.loads(args.spec.read_text()))
    result = asyncio.run(run_system(spec))
    args.out.write_text(json.dumps(result.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
