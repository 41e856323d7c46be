"""What topic-shift detection adds to a customer's wait, measured through the websocket of a real ``kvchat serve``.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.topic_latency     # clf-static against none, 24 sessions

One server (the tiny model, replies of ``--max-tokens`` tokens, so a turn is mostly the backend's own work), one
tenant. Sessions replay the customer messages of held-out CuCom conversations, under the control ``none`` (a tracker
that never shifts: no embedding, no classifier) and under each scorer measured. For every customer message: the
time from sending ``user.message`` to the first ``message.delta`` of its reply (the topic is decided in between,
before the prompt is built). Each scorer has its own session, and the sessions take each message in turn (the
tenant's scorer set through the admin API before each), so a scorer's wait is paired with the control's wait for the
same message moments before. Reported per scorer: p50 and p90 over all messages, and the median of the paired
differences (the latency added). A first session of each is a warm-up (it loads the scorer's model), not counted.

Writes ``docs/benchmarks/topic_latency.json``, with the machine it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.datasets import CONVERSATIONS
from bench.load import CHAT_TOKEN, LoadConfig, Server, running_server
from bench.reporting import machine_info
from bench.shift_sets import load_conversations

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "topic_latency.json"
ADMIN_KEY = "load-admin-key"  # bench.load's bootstrap admin key
CONTROL = "none"
TIMEOUT_S = 120.0


async def set_scorer(http: httpx.AsyncClient, name: str) -> None:
    """The tenant's context settings with topic scorer ``name`` (its tuned threshold; the rest as they are)."""
    from backend.context.topic import TUNED_SETTINGS

    headers = {"X-API-Key": ADMIN_KEY}
    current = (await http.get("/admin/tenant/context-settings", headers=headers)).json()
    wanted = current | {"similarity_backend": name, "shift_threshold": TUNED_SETTINGS[name].shift_threshold}
    put = await http.put("/admin/tenant/context-settings", headers=headers, json=wanted)
    put.raise_for_status()


class Session:
    """One websocket session of the chat token's tenant."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, server: Server, stack: contextlib.AsyncExitStack) -> Session:
        ws = await stack.enter_async_context(websockets.connect(server.ws, open_timeout=TIMEOUT_S, max_size=None))
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        if welcome["type"] != "welcome":
            raise RuntimeError(f"no welcome: {welcome}")
        return cls(ws)

    async def turn(self, text: str) -> float:
        """Seconds from sending ``text`` to its reply's first delta (the reply is awaited to its end)."""
        sent = time.perf_counter()
        await self.ws.send(json.dumps({"type": "user.message", "client_msg_id": uuid.uuid4().hex, "text": text}))
        first: float | None = None
        while True:
            frame = json.loads(await asyncio.wait_for(self.ws.recv(), TIMEOUT_S))
            if frame["type"] == "message.delta" and first is None:
                first = time.perf_counter() - sent
            elif frame["type"] == "message.completed":
                break
            elif frame["type"] == "error":
                raise RuntimeError(f"the server refused a turn: {frame}")
        if first is None:
            raise RuntimeError("a reply without any delta: raise --max-tokens")
        return first


async def replay(
    server: Server, http: httpx.AsyncClient, scorers: list[str], messages: Sequence[str]
) -> dict[str, list[float]]:
    """One session per scorer, the same customer messages in each, in turn: message i goes to every session (the
    tenant's scorer set before each) before message i + 1 goes to any, so each scorer's wait has a control's
    measured moments before it."""
    waits: dict[str, list[float]] = {name: [] for name in scorers}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {name: await Session.open(server, stack) for name in scorers}
        for text in messages:
            for name in scorers:
                await set_scorer(http, name)
                waits[name].append(await sessions[name].turn(text))
    return waits


async def measure(server: Server, scorers: list[str], conversations: list[list[str]], sessions: int) -> dict[str, Any]:
    waits: dict[str, list[float]] = {name: [] for name in scorers}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=TIMEOUT_S) as http:
        await replay(server, http, scorers, conversations[0])  # warm-up: each scorer's model loads on first use
        for i in range(sessions):
            for name, w in (await replay(server, http, scorers, conversations[1 + i])).items():
                waits[name] += w
            print(f"session {i + 1}/{sessions}", file=sys.stderr, flush=True)
    control = waits[CONTROL]
    return {
        name: {
            "messages": len(w),
            "first_delta_ms_p50": round(1000 * statistics.median(w), 2),
            "first_delta_ms_p90": round(1000 * statistics.quantiles(w, n=10)[-1], 2),
            "added_ms_p50": round(1000 * statistics.median(a - b for a, b in zip(w, control, strict=True)), 2),
        }
        for name, w in waits.items()
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| scorer | messages | send → first delta p50 | p90 | added (median of paired differences) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['messages']} | {r['first_delta_ms_p50']:.1f} ms | {r['first_delta_ms_p90']:.1f} ms "
            f"| {r['added_ms_p50']:+.1f} ms |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.topic_latency", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--scorers", default="clf-static", help="comma list of the scorers to measure against none")
    p.add_argument("--sessions", type=int, default=24, help="measured sessions per scorer")
    p.add_argument("--max-tokens", type=int, default=2, help="reply tokens per turn")
    p.add_argument("--model", default="tiny", help="tiny (built here), smollm2, or a model folder")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scorers = [CONTROL, *(n for n in args.scorers.split(",") if n and n != CONTROL)]
    held_out = load_conversations(CONVERSATIONS)[1000:]
    conversations = [[t.text for t in c if t.customer] for c in held_out[: args.sessions + 1]]
    config = LoadConfig(args.model, 2, 2, (1,), 0.0, 0.0, args.max_tokens, 0.0, 0.0, 0)
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-topic-latency-") as workdir,
        running_server(config, Path(workdir)) as server,
    ):
        results = asyncio.run(measure(server, scorers, conversations, args.sessions))
    print(table(results))
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.topic_latency " + " ".join(sys.argv[1:])
    report = {
        "command": command.strip(),
        "model": args.model,
        "reply_max_tokens": args.max_tokens,
        "sessions_per_scorer": args.sessions,
        "target": {"added_ms_p50_max": 15.0},
        "machine": machine_info(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
