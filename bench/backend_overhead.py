"""Backend overhead (issue 30, P7): what the chat backend adds to a reply's first token, 100 sessions at once.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.backend_overhead

One ``kvchat serve`` (the tiny model: the engine's own time is small, so the backend's is what shows), ``--sessions``
websocket sessions of one tenant open at once. Each replays the customer messages of a held-out CuCom conversation:
send a message, wait for its reply to complete, think (uniform 0..2x ``--think-s``), send the next. The sessions
start spread over one think time, so the turns arrive as a steady stream, not as one burst.

For every turn: **overhead = (first ``message.delta`` seen by the client − send) − the engine's own TTFT**
(``usage.ttft_ms`` of the completion: the request's arrival in the engine → its first token, queueing in the engine
included). What remains is the backend's: storing the message, the context layer (blocks, topic), loading the
context, building and tokenizing the prompt, handing it to the engine, and carrying the first token back out through
the hub and the socket (with the client's own receive on the same machine). Target: p99 ≤ 10 ms.

A warm-up session (one conversation, not counted) loads the topic scorer and warms the caches first. Writes
``docs/benchmarks/backend_overhead.json`` (every turn's figures, the machine it ran on, the command).

``--engine-modes inproc,process`` measures each engine mode (``KVCHAT_ENGINE_MODE``) in turn, in the same run, on a
fresh server each, and prints each mode's figures against the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from bench.agent_fanout import scratch_database
from bench.datasets import CONVERSATIONS
from bench.load import CHAT_TOKEN, LoadConfig, Server, running_server
from bench.reporting import machine_info, reproduce_command, write_json
from bench.shift_sets import load_conversations

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "backend_overhead.json"
TARGET_P99_MS = 10.0
TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """One turn as the client saw it (milliseconds from its send)."""

    session: int
    turn: int
    ack_ms: float  # message.ack: the message is stored
    first_delta_ms: float
    completed_ms: float
    engine_ttft_ms: float  # usage.ttft_ms
    steps_ms: dict[str, float] | None = None  # usage.steps_ms: the server's marks, from the frame taken
    prompt_tokens: int = 0  # usage.prompt_tokens: the prompt's length
    prefilled_tokens: int = 0  # usage.prefilled_tokens: the ones the engine computed (the rest came from its cache)

    @property
    def overhead_ms(self) -> float:
        return self.first_delta_ms - self.engine_ttft_ms


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        return cls(len(values), round(cuts[49], 2), round(cuts[89], 2), round(cuts[98], 2), round(max(values), 2))


async def converse(
    server: Server, index: int, messages: Sequence[str], think_s: float, start_s: float, rng: random.Random
) -> list[TurnTiming]:
    """One session: hello, then each message in turn, its reply awaited to the end, a think time between."""
    await asyncio.sleep(start_s)
    timings = []
    async with websockets.connect(server.ws, open_timeout=TIMEOUT_S, max_size=None) as ws:
        hello = {"type": "hello", "token": CHAT_TOKEN, "external_ref": f"overhead-{index}"}
        await ws.send(json.dumps(hello))
        welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        if welcome["type"] != "welcome":
            raise RuntimeError(f"no welcome: {welcome}")
        for turn, text in enumerate(messages):
            if turn:
                await asyncio.sleep(rng.uniform(0, 2 * think_s))
            timing = await _turn(ws, index, turn, text)
            if timing is None:
                break  # the customer asked for a human: the bot answers no more in this session
            timings.append(timing)
    return timings


async def _turn(ws: ClientConnection, session: int, turn: int, text: str) -> TurnTiming | None:
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": uuid.uuid4().hex, "text": text}))
    ack: float | None = None
    first: float | None = None
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            frame = json.loads(await ws.recv())
            now = (time.perf_counter() - sent) * 1000
            kind = frame["type"]
            if kind == "message.ack":
                ack = now
            elif kind == "message.delta" and first is None:
                first = now
            elif kind == "message.completed":
                usage = frame.get("usage")
                if ack is None or first is None or usage is None:
                    raise RuntimeError(f"a turn without ack, delta or usage: {frame} (raise --max-tokens?)")
                steps = usage.get("steps_ms")
                ttft = float(usage["ttft_ms"])
                prompt, prefilled = int(usage.get("prompt_tokens", 0)), int(usage.get("prefilled_tokens", 0))
                return TurnTiming(session, turn, ack, first, now, ttft, steps, prompt, prefilled)
            elif kind == "session.status" and frame["status"] != "bot_active":
                return None
            elif kind == "error":
                raise RuntimeError(f"the server refused a turn: {frame}")


async def measure(
    server: Server, conversations: list[list[str]], think_s: float, seed: int
) -> tuple[list[TurnTiming], float]:
    """The warm-up session alone, then every measured session at once. Returns the turns and the wall time."""
    await converse(server, -1, conversations[0], 0.0, 0.0, random.Random(seed))
    rng = random.Random(seed)
    sessions = [
        converse(server, i, messages, think_s, rng.uniform(0, think_s), random.Random(rng.random()))
        for i, messages in enumerate(conversations[1:])
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*sessions)
    return [t for session in results for t in session], time.perf_counter() - start


# The server's steps (``usage.steps_ms``, backend/chat/turn_marks.py), each timed from the one before it.
STEPS = ("stored", "started", "planned", "submitted", "first_token", "first_shown")


def step_spans(t: TurnTiming) -> dict[str, float] | None:
    """Each server step's own milliseconds, and ``transit``: the client's send to its first delta less the server's
    frame-taken to first-shown (the socket both ways and the event loop's queue before the frame is taken)."""
    if not t.steps_ms or any(s not in t.steps_ms for s in STEPS):
        return None
    out, before = {}, 0.0
    for s in STEPS:
        out[s] = t.steps_ms[s] - before
        before = t.steps_ms[s]
    out["transit"] = t.first_delta_ms - t.steps_ms["first_shown"]
    return out


def step_summary(turns: Sequence[TurnTiming]) -> dict[str, Any]:
    spans = [s for s in (step_spans(t) for t in turns) if s is not None]
    if len(spans) < 2:
        return {}
    return {k: asdict(Percentiles.of([s[k] for s in spans])) for k in spans[0]}


def summary(turns: Sequence[TurnTiming], wall_s: float) -> dict[str, Any]:
    return {
        "steps_ms": step_summary(turns),
        "turns": len(turns),
        "turns_per_s": round(len(turns) / wall_s, 2),
        # what the engine did per turn: the prompt, and the part of it computed (not from the cache)
        "prompt_tokens_mean": round(statistics.fmean(t.prompt_tokens for t in turns), 1),
        "prefilled_tokens_mean": round(statistics.fmean(t.prefilled_tokens for t in turns), 1),
        "overhead_ms": asdict(Percentiles.of([t.overhead_ms for t in turns])),
        "first_delta_ms": asdict(Percentiles.of([t.first_delta_ms for t in turns])),
        "engine_ttft_ms": asdict(Percentiles.of([t.engine_ttft_ms for t in turns])),
        "ack_ms": asdict(Percentiles.of([t.ack_ms for t in turns])),
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| ms | p50 | p90 | p99 | max |", "|---|---|---|---|---|"]
    names = {
        "overhead_ms": "**overhead** (first delta − engine TTFT)",
        "first_delta_ms": "send → first delta",
        "engine_ttft_ms": "engine TTFT",
        "ack_ms": "send → ack (message stored)",
    }
    for key, label in names.items():
        p = result[key]
        lines.append(f"| {label} | {p['p50']:.1f} | {p['p90']:.1f} | {p['p99']:.1f} | {p['max']:.1f} |")
    for key, p in result.get("steps_ms", {}).items():
        label = f"step {key}" if key != "transit" else "transit (socket both ways + queue before the frame is taken)"
        lines.append(f"| {label} | {p['p50']:.1f} | {p['p90']:.1f} | {p['p99']:.1f} | {p['max']:.1f} |")
    return "\n".join(lines)


def ratios(mode: dict[str, Any], base: dict[str, Any]) -> str:
    """``mode``'s turns/s and overhead p50/p99 over ``base``'s."""
    turns = mode["turns_per_s"] / base["turns_per_s"]
    p50 = mode["overhead_ms"]["p50"] / base["overhead_ms"]["p50"]
    p99 = mode["overhead_ms"]["p99"] / base["overhead_ms"]["p99"]
    return f"turns/s {turns:.2f}x, overhead p50 {p50:.2f}x, p99 {p99:.2f}x"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.backend_overhead", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sessions", type=int, default=100, help="websocket sessions open at once")
    p.add_argument("--turns", type=int, default=6, help="customer messages per session (at most)")
    p.add_argument("--think-s", type=float, default=2.0, help="mean think time between a reply and the next message")
    p.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn (KVCHAT_REPLY_MAX_TOKENS)")
    p.add_argument("--model", default="tiny", help="tiny (built here), smollm2, or a model folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-modes", default="inproc", help="comma-separated KVCHAT_ENGINE_MODEs, measured in turn")
    p.add_argument(
        "--postgres",
        metavar="ADMIN_URL",
        default=None,
        help="run each server on a scratch Postgres database made from this one (default: SQLite)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    held_out = load_conversations(CONVERSATIONS)[1000:]
    customer = [[t.text for t in c if t.customer][: args.turns] for c in held_out]
    conversations = [c for c in customer if c][: args.sessions + 1]
    if len(conversations) < args.sessions + 1:
        raise SystemExit(f"only {len(conversations) - 1} held-out conversations for {args.sessions} sessions")
    config = LoadConfig(args.model, 32, 256, (1,), 0.0, 0.0, args.max_tokens, 0.0, 0.0, args.seed)
    modes = [m.strip() for m in args.engine_modes.split(",") if m.strip()]
    by_mode: dict[str, dict[str, Any]] = {}
    every: dict[str, list[TurnTiming]] = {}
    for mode in modes:
        os.environ["KVCHAT_ENGINE_MODE"] = mode  # (the server subprocess inherits it: bench.load.running_server)
        with contextlib.ExitStack() as stack:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvchat-overhead-"))
            database = stack.enter_context(scratch_database(args.postgres)) if args.postgres else None
            s = stack.enter_context(running_server(config, Path(workdir), database))
            turns, wall_s = asyncio.run(measure(s, conversations, args.think_s, args.seed))
        by_mode[mode], every[mode] = summary(turns, wall_s), turns
        r = by_mode[mode]
        print(
            f"engine mode {mode}: {r['turns_per_s']} turns/s, prompt {r['prompt_tokens_mean']} tokens a turn, "
            f"{r['prefilled_tokens_mean']} computed\n{table(r)}"
        )
        p99 = by_mode[mode]["overhead_ms"]["p99"]
        verdict = "met" if p99 <= TARGET_P99_MS else "missed"
        print(f"overhead p99 {p99:.1f} ms (target ≤ {TARGET_P99_MS:.0f} ms: {verdict})")
    for mode in modes[1:]:
        print(f"{mode} / {modes[0]}: {ratios(by_mode[mode], by_mode[modes[0]])}")
    result = by_mode[modes[0]]
    turns = every[modes[0]]
    command = "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.backend_overhead", sys.argv[1:])
    report = {
        "command": command,
        "config": {
            "model": args.model,
            "sessions": args.sessions,
            "turns_per_session_max": args.turns,
            "think_s_mean": args.think_s,
            "reply_max_tokens": args.max_tokens,
            "max_num_seqs": config.seqs,
            "max_waiting": config.waiting,
            "database": "postgres (a scratch database)" if args.postgres else "sqlite (bench.load's server)",
            "engine_modes": modes,
        },
        "target": {"overhead_ms_p99_max": TARGET_P99_MS},
        "machine": machine_info(),
        "result": result,  # (the first engine mode's)
        "by_engine_mode": by_mode,
        "turns": [asdict(t) | {"overhead_ms": round(t.overhead_ms, 3)} for t in turns],
        "turns_by_engine_mode": {
            m: [asdict(t) | {"overhead_ms": round(t.overhead_ms, 3)} for t in ts] for m, ts in every.items()
        },
    }
    write_json(args.out, report)
    print(f"wrote {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
