"""Fair share between tenants (issue 42) against a real ``kvchat serve`` process with the real model (SmolLM2-135M).

Tenant B chats steadily (one message every ``--b-period`` seconds, one session) while tenant A:

- **b_alone**: is quiet (the control);
- **b_beside_sessions**: floods with ``--flood-sessions`` websocket sessions at once, each sending its next message as
  soon as its reply is done;
- **b_beside_streams**: opens ``--flood-streams`` ``/v1/chat/completions`` streams at once.

Then both tenants keep ``--backlog-sessions`` sessions busy for ``--backlog-s`` seconds, with equal weights
(**split_equal**) and with A's weight 2 (**split_weighted**, set through ``/admin/fair-share``), and A alone does
the same (**lone**: its throughput, to compare with the same phase of a first-come-first-served build). Served
tokens are counted by the client from each reply's usage: prompt tokens prefilled + completion tokens, of the
replies that finished inside the window.

``--repo`` runs the server from another checkout (e.g. the last FCFS commit) with the same client: phases the
server does not support (weights) are skipped. Prints a table, writes JSON and a PNG (B's TTFT per phase, the
server's RSS over time)::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.fairness \\
        --database-url postgresql://postgres@127.0.0.1:5432/kvchat_fairness
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.hardening import Latencies, Server, add_tenant, wait_ready
from bench.load import REPO_ROOT
from bench.reporting import machine_info
from bench.runners.kvchat_ws import free_port

CHAT_TOKEN = "fairness-chat-token"
ADMIN_KEY = "fairness-admin-key"
OPERATOR_TOKEN = "fairness-operator-token"
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "fairness.json"
TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Config:
    database_url: str
    repo: Path = REPO_ROOT
    model: str = "smollm2"
    flood_sessions: int = 60
    flood_streams: int = 200
    b_turns: int = 8
    b_period_s: float = 2.0
    backlog_sessions: int = 32
    backlog_s: float = 30.0
    reply_tokens: int = 32
    seqs: int = 32
    waiting: int = 256
    latency_only: bool = False  # only B's three TTFT phases (no splits, no lone throughput)


@dataclass(slots=True)
class Served:
    """Replies that finished in a window, and what the engine computed for them."""

    replies: int = 0
    prefilled: int = 0
    completion: int = 0

    @property
    def tokens(self) -> int:
        return self.prefilled + self.completion

    def add(self, usage: dict[str, Any]) -> None:
        self.replies += 1
        self.prefilled += int(usage["prefilled_tokens"])
        self.completion += int(usage["completion_tokens"])


@dataclass(slots=True)
class RssTimeline:
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)


# ---------------------------------------------------------------------------------------------------- the server


def server_env(config: Config, data_dir: Path) -> dict[str, str]:
    return {
        "KVCHAT_DATABASE_URL": config.database_url,
        "KVCHAT_MODEL": config.model,
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": CHAT_TOKEN,
        "KVCHAT_BOOTSTRAP_ADMIN_KEY": ADMIN_KEY,
        "KVCHAT_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "KVCHAT_MAX_NUM_SEQS": str(config.seqs),
        "KVCHAT_MAX_WAITING": str(config.waiting),
        "KVCHAT_MAX_CONNECTIONS_PER_TENANT": "1000",
        "KVCHAT_MAX_CONNECTIONS_PER_CLIENT": "1000",
        "KVCHAT_REPLY_MAX_TOKENS": str(config.reply_tokens),
        "KVCHAT_WS_RATE_PER_SECOND": "1000",
        "KVCHAT_WS_RATE_BURST": "1000",
        "KVCHAT_KV_DISK_CACHE": "false",
        "KVCHAT_LOG_LEVEL": "warning",
    }


@contextmanager
def running_server(config: Config, workdir: Path, extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    """``kvchat serve`` from ``config.repo`` as a subprocess, stopped with SIGTERM afterwards; ``extra_env`` overrides
    this benchmark's settings (``bench/refusals.py`` sets its caps)."""
    port = free_port()
    env = os.environ | server_env(config, workdir) | (extra_env or {})
    env |= {"KVCHAT_HOST": "127.0.0.1", "KVCHAT_PORT": str(port)}
    log_path = workdir / "server.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"], cwd=config.repo, env=env, stdout=log, stderr=log
        )
    server = Server(proc, port, log_path)
    try:
        wait_ready(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


# ---------------------------------------------------------------------------------------------------- clients


async def open_session(ws_url: str, token: str) -> Any:
    ws = await websockets.connect(ws_url, open_timeout=TIMEOUT_S, max_size=2**22)
    await ws.send(json.dumps({"type": "hello", "token": token}))
    welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    if welcome.get("type") != "welcome":
        raise RuntimeError(f"hello answered with {welcome}")
    return ws


async def turn(ws: Any, text: str, msg_id: str) -> tuple[float | None, dict[str, Any] | None]:
    """Send ``text``: (seconds to the first delta, the reply's usage); (None, None) when it ended in an error."""
    start = time.perf_counter()
    first: float | None = None
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": text}))
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        if frame["type"] == "message.delta" and first is None:
            first = time.perf_counter() - start
        elif frame["type"] == "message.completed":
            return first, frame.get("usage")
        elif frame["type"] == "error":
            return None, None


async def steady_b(ws: Any, config: Config, tag: str) -> dict[str, Any]:
    """B's turns, one every ``b_period_s`` (or as soon as the previous one is done, when it took longer): its TTFT
    as the client sees it, and as the engine reports it (``usage.ttft_ms``: from the engine's arrival on; the rest
    is the backend's part)."""
    ttft, engine_ttft, turns = Latencies(), Latencies(), list[dict[str, Any]]()
    t0 = time.perf_counter()
    for n in range(config.b_turns):
        started = time.perf_counter()
        first, usage = await turn(ws, f"Hello, is my order {n} on its way?", f"b-{tag}-{n}")
        if first is not None:
            ttft.values.append(first)
        if usage is not None:
            engine_ttft.values.append(float(usage["ttft_ms"]) / 1000)
        turns.append(turn_record(started - t0, first, usage))
        await asyncio.sleep(max(0.0, config.b_period_s - (time.perf_counter() - started)))
    return {"b_ttft": ttft.summary(), "b_engine_ttft": engine_ttft.summary(), "b_turns": turns}


def turn_record(at_s: float, first: float | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """One of B's turns: ``engine_s`` from the engine's arrival to its first token (queue + steps), ``backend_s`` the
    rest of the client's TTFT (edge, context, tokenizing, the event loop and the socket, both ways)."""
    engine = float(usage["ttft_ms"]) / 1000 if usage is not None else None
    backend = None if first is None or engine is None else first - engine
    prompt = None if usage is None else (usage["prompt_tokens"], usage["prefilled_tokens"])
    steps = None if usage is None else usage.get("steps_ms")  # (where the backend's part went: chat/turn_marks.py)
    record = {"at_s": round(at_s, 3), "ttft_s": first, "engine_s": engine, "backend_s": backend, "prompt": prompt}
    return record | {"steps_ms": steps}


async def closed_loop(
    ws: Any, name: str, stop: asyncio.Event, window: tuple[list[float], Served] | None, ttfts: list[float]
) -> None:
    """Send turns back to back until ``stop``; replies finishing inside the window (while it is open) are counted."""
    n = 0
    while not stop.is_set():
        first, usage = await turn(ws, f"Order {name}-{n}: where is my parcel? It was due on Monday.", f"{name}-{n}")
        if first is not None:
            ttfts.append(first)
        if window is not None and usage is not None and window[0] and not stop.is_set():
            window[1].add(usage)
        n += 1


async def stream_once(http: httpx.AsyncClient, n: int, max_tokens: int) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"Question {n}: what is your return policy?"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            pass
        return str(response.status_code)


# ---------------------------------------------------------------------------------------------------- phases


async def b_alone(b: Any, config: Config) -> dict[str, Any]:
    return await steady_b(b, config, "alone")


async def b_beside_sessions(server: Server, config: Config, b: Any) -> dict[str, Any]:
    sessions = await asyncio.gather(*(open_session(server.ws, CHAT_TOKEN) for _ in range(config.flood_sessions)))
    stop, a_ttfts = asyncio.Event(), list[float]()
    loops = [asyncio.create_task(closed_loop(ws, f"a{i}", stop, None, a_ttfts)) for i, ws in enumerate(sessions)]
    await asyncio.sleep(0.5)  # (A's 60 messages are in first)
    b_turns = await steady_b(b, config, "sessions")
    stop.set()
    await asyncio.gather(*loops)
    await asyncio.gather(*(ws.close() for ws in sessions))
    return b_turns | {"a_ttft": Latencies(a_ttfts).summary(), "a_replies": len(a_ttfts)}


async def b_beside_streams(server: Server, config: Config, b: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {CHAT_TOKEN}"}
    limits = httpx.Limits(max_connections=config.flood_streams + 10)
    async with httpx.AsyncClient(base_url=server.http, headers=headers, timeout=TIMEOUT_S, limits=limits) as http:
        streams = [asyncio.create_task(stream_once(http, n, config.reply_tokens)) for n in range(config.flood_streams)]
        await asyncio.sleep(0.5)
        b_turns = await steady_b(b, config, "streams")
        statuses = await asyncio.gather(*streams, return_exceptions=True)
    counts: dict[str, int] = {}
    for s in statuses:
        key = s if isinstance(s, str) else type(s).__name__
        counts[key] = counts.get(key, 0) + 1
    return b_turns | {"a_statuses": counts}


async def backlog(server: Server, config: Config, tokens: dict[str, str]) -> dict[str, Any]:
    """Each tenant in ``tokens`` keeps ``backlog_sessions`` busy; what each was served inside the window."""
    stop, opened = asyncio.Event(), []
    served = {name: Served() for name in tokens}
    window: dict[str, tuple[list[float], Served]] = {name: ([], served[name]) for name in tokens}
    loops = []
    for name, token in tokens.items():
        for i in range(config.backlog_sessions):
            ws = await open_session(server.ws, token)
            opened.append(ws)
            loops.append(asyncio.create_task(closed_loop(ws, f"{name}{i}", stop, window[name], [])))
    await asyncio.sleep(min(10.0, config.backlog_s / 3))  # warm-up: every session backlogged before counting
    for w in window.values():
        w[0].append(time.perf_counter())
    await asyncio.sleep(config.backlog_s)
    stop.set()
    await asyncio.gather(*loops)
    await asyncio.gather(*(ws.close() for ws in opened))
    total = sum(s.tokens for s in served.values()) or 1
    return {
        name: asdict(s) | {"tokens": s.tokens, "share": s.tokens / total, "tokens_per_s": s.tokens / config.backlog_s}
        for name, s in served.items()
    }


async def set_weight(server: Server, tenant_id: str, weight: float) -> bool:
    """False when the server has no fair-share API (an older build)."""
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as http:
        r = await http.put(
            f"/admin/fair-share/{tenant_id}",
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
            json={"weight": weight},
        )
    return r.status_code == 200


async def tenant_id_of(server: Server, admin_key: str) -> str:
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as http:
        for header in ({"Authorization": f"Bearer {admin_key}"}, {"X-API-Key": admin_key}):
            r = await http.get("/admin/tenant", headers=header)
            if r.status_code == 200:
                return str(r.json()["id"])
    raise RuntimeError("cannot read the tenant's id")


async def engine_queue(server: Server, tenant_ids: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Per tenant: (seconds its requests waited in the engine's queue, requests), from ``/metrics`` (an older build
    without the per-tenant series: empty)."""
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as http:
        text = (await http.get("/metrics")).text
    by_id = {v: k for k, v in tenant_ids.items()}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            if line.startswith(f"kvchat:tenant_queue_seconds{suffix}{{"):
                tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                if tenant in by_id:
                    out.setdefault(by_id[tenant], [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {name: (v[0], v[1]) for name, v in out.items()}


def queue_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Mean engine queue time (s) per tenant between two scrapes."""
    delta: dict[str, float | None] = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        delta[name] = (total - t0) / (count - c0) if count > c0 else None
    return delta


async def sample_rss(server: Server, into: RssTimeline, t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        into.samples.append((time.perf_counter() - t0, server.rss_mib()))
        await asyncio.sleep(0.5)


async def run_phases(server: Server, config: Config) -> dict[str, Any]:
    t0, rss, stop = time.perf_counter(), RssTimeline(), asyncio.Event()
    sampler = asyncio.create_task(sample_rss(server, rss, t0, stop))
    b_token, b_admin = await add_tenant(config.database_url, f"tenant-b-{time.time_ns()}")
    a_id = await tenant_id_of(server, ADMIN_KEY)
    ids = {"A": a_id, "B": await tenant_id_of(server, b_admin)}
    b = await open_session(server.ws, b_token)
    phases: dict[str, Any] = {}
    marks: list[tuple[str, float]] = []
    try:
        await turn(b, "hello", "b-warm")
        for name, phase in (
            ("b_alone", lambda: b_alone(b, config)),
            ("b_beside_sessions", lambda: b_beside_sessions(server, config, b)),
            ("b_beside_streams", lambda: b_beside_streams(server, config, b)),
            ("split_equal", lambda: backlog(server, config, {"A": CHAT_TOKEN, "B": b_token})),
        ):
            if config.latency_only and name == "split_equal":
                return {"phases": phases, "rss_mib": rss.samples, "phase_starts_s": marks}
            marks.append((name, time.perf_counter() - t0))
            before = await engine_queue(server, ids)
            phases[name] = await phase()
            phases[name]["engine_queue_mean_s"] = queue_delta(before, await engine_queue(server, ids))
            print(f"{name}: {json.dumps(phases[name])}", flush=True)
        if await set_weight(server, a_id, 2.0):
            marks.append(("split_weighted", time.perf_counter() - t0))
            before = await engine_queue(server, ids)
            phases["split_weighted"] = await backlog(server, config, {"A": CHAT_TOKEN, "B": b_token})
            phases["split_weighted"]["engine_queue_mean_s"] = queue_delta(before, await engine_queue(server, ids))
            print(f"split_weighted: {json.dumps(phases['split_weighted'])}", flush=True)
            await set_weight(server, a_id, 1.0)
        marks.append(("lone", time.perf_counter() - t0))
        phases["lone"] = await backlog(server, config, {"A": CHAT_TOKEN})
        print(f"lone: {json.dumps(phases['lone'])}", flush=True)
    finally:
        await b.close()
        stop.set()
        await sampler
    return {"phases": phases, "rss_mib": rss.samples, "phase_starts_s": marks}


# ---------------------------------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(report: dict[str, Any]) -> str:
    p = report["phases"]
    alone = p["b_alone"]["b_ttft"]
    lines = [f"{'B TTFT (ms)':<34}{'p50':>8}{'p99':>8}{'n':>5}{'p99 / alone':>13}{'engine p50':>12}{'engine p99':>12}"]
    for key, label in (
        ("b_alone", "alone (control)"),
        ("b_beside_sessions", f"beside A's {report['config']['flood_sessions']} sessions"),
        ("b_beside_streams", f"beside A's {report['config']['flood_streams']} /v1 streams"),
    ):
        s = p[key]["b_ttft"]
        ratio = s["p99"] / alone["p99"] if s["p99"] and alone["p99"] else None
        e = p[key].get("b_engine_ttft", {"p50": None, "p99": None})
        lines.append(
            f"{label:<34}{_ms(s['p50']):>8}{_ms(s['p99']):>8}{s['n']:>5}{'-' if ratio is None else f'{ratio:.1f}x':>13}"
            f"{_ms(e['p50']):>12}{_ms(e['p99']):>12}"
        )
    for key in ("b_alone", "b_beside_sessions", "b_beside_streams"):
        turns = p[key].get("b_turns", [])
        cells = [f"{_ms(t['ttft_s'])}={_ms(t['engine_s'])}+{_ms(t['backend_s'])}" for t in turns]
        if cells:
            lines.append(f"  {key} per turn, client = engine + backend (ms): {' '.join(cells)}")
    for key in ("split_equal", "split_weighted"):
        if key in p:
            a, b = p[key]["A"], p[key]["B"]
            ratio = a["tokens"] / b["tokens"] if b["tokens"] else float("inf")
            lines.append(f"{key}: A {a['tokens']} tokens, B {b['tokens']} tokens, A/B = {ratio:.2f}")
    if lone := p.get("lone", {}).get("A"):
        lines.append(f"lone A: {lone['tokens_per_s']:.1f} served tokens/s ({lone['completion']} completion tokens)")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    p = report["phases"]
    names = ["b_alone", "b_beside_sessions", "b_beside_streams"]
    p99 = [p[n]["b_ttft"]["p99"] or 0.0 for n in names]
    p50 = [p[n]["b_ttft"]["p50"] or 0.0 for n in names]
    x = range(len(names))
    left.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    left.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    left.set_xticks(list(x), ["alone", "beside sessions", "beside streams"])
    left.set_ylabel("tenant B TTFT (s)")
    left.legend()
    ts = [t for t, _ in report["rss_mib"]]
    right.plot(ts, [m for _, m in report["rss_mib"]])
    for name, at in report["phase_starts_s"]:
        right.axvline(at, color="grey", linewidth=0.5)
        right.text(at, right.get_ylim()[1], name, rotation=90, va="top", fontsize=7)
    right.set_xlabel("seconds")
    right.set_ylabel("server RSS (MiB)")
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", required=True, help="an empty Postgres database (migrated at start)")
    p.add_argument("--repo", type=Path, default=REPO_ROOT, help="the checkout whose server runs")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--flood-sessions", type=int, default=60)
    p.add_argument("--flood-streams", type=int, default=200)
    p.add_argument("--b-turns", type=int, default=8)
    p.add_argument("--b-period", type=float, default=2.0)
    p.add_argument("--backlog-sessions", type=int, default=32, help="per tenant; above --seqs in all, so both queue")
    p.add_argument("--backlog-s", type=float, default=30.0)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--seqs", type=int, default=32, help="KVCHAT_MAX_NUM_SEQS: the engine's running slots")
    p.add_argument("--latency-only", action="store_true", help="only B's TTFT phases (alone, beside the floods)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON result (the PNG goes next to it)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = Config(
        args.database_url,
        args.repo.resolve(),
        args.model,
        args.flood_sessions,
        args.flood_streams,
        args.b_turns,
        args.b_period,
        args.backlog_sessions,
        args.backlog_s,
        args.reply_tokens,
        args.seqs,
        latency_only=args.latency_only,
    )
    with tempfile.TemporaryDirectory(prefix="kvchat-fairness-") as tmp, running_server(config, Path(tmp)) as server:
        report = asyncio.run(run_phases(server, config))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=config.repo, capture_output=True, text=True)
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.fairness " + shlex.join(argv or sys.argv[1:])
    report = {
        "title": f"kvchat fair share at {commit.stdout.strip()} ({config.repo.name})",
        "command": command,
        "machine": machine_info(),
        "config": asdict(config) | {"repo": str(config.repo), "database_url": "(see command)"},
    } | report
    print(table(report))
    print(f"\ncommand: {command}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
