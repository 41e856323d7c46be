"""Agents' replies, fanned out (issue 41): 50 customer sockets handed off to 5 agents, 1,000 agent messages; how long
each takes to reach its customer's socket, on one worker and across two.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.agent_fanout

Two ``kvchat serve`` workers (the tiny model: no bot turn runs here) on a fresh Postgres database (created from
``--postgres`` and dropped afterwards). Per scenario: ``--customers`` sockets open a session each and ask for a person;
``--agents`` agents claim them round robin; then every agent sends its share of ``--messages`` replies, one at a time
with ``--interval-ms`` between two of its own (the agents run at once). Scenario ``one_worker``: the customers and
the agents' requests are on worker A; ``two_workers``: the customers are on A, the agents post to B, so every message
crosses the LISTEN/NOTIFY fan-out.

Two latencies per message, both ending when the customer's socket has the ``agent.message``:

- **fan-out** (the target's): from the message's ``created_at`` (the server's clock, set just before the transaction
  that stores it commits; the same host's clock as this program's) — the commit, the hub, LISTEN/NOTIFY to the other
  worker, the customer's socket;
- **end to end**: from the agent's POST being sent — the HTTP request, authentication and the locked insert too.

Every message is checked: received once, by its own customer, none lost. Targets (fan-out): p99 ≤ 50 ms on one
worker, ≤ 100 ms across two. NOTE: ``--interval-ms`` 100 makes 5 agents send 50 messages a second in all, far above
people typing, so the queueing the figures show is the server's, not a burst this program makes. Writes
``docs/benchmarks/agent_fanout.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import websockets

from bench.metrics import percentile
from bench.reporting import format_table, machine_info, reproduce_command, write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "agent_fanout.json"
CHAT_TOKEN = "bench-agent-chat"
ADMIN_KEY = "bench-agent-admin"
TARGETS_P99_MS = {"one_worker": 50.0, "two_workers": 100.0}
TIMEOUT_S = 60.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def worker(name: str, database_url: str, model: Path, workdir: Path, migrate: bool) -> Iterator[str]:
    """``kvchat serve`` on a free port until the block ends (SIGTERM); yields its base URL."""
    port = _free_port()
    (workdir / name).mkdir()
    env = os.environ | {
        "KVCHAT_HOST": "127.0.0.1", "KVCHAT_PORT": str(port), "KVCHAT_DATABASE_URL": database_url,
        "KVCHAT_MODEL": str(model), "KVCHAT_ENGINE_DEVICE": "cpu", "KVCHAT_ENGINE_DTYPE": "float32",
        "KVCHAT_MAX_KV_MEMORY_MB": "16", "KVCHAT_DATA_DIR": str(workdir / name), "KVCHAT_KV_DISK_CACHE": "false",
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": CHAT_TOKEN, "KVCHAT_BOOTSTRAP_ADMIN_KEY": ADMIN_KEY,
        "KVCHAT_RUN_MIGRATIONS_ON_START": str(migrate).lower(), "KVCHAT_LOG_LEVEL": "warning",
        "KVCHAT_MAX_CONNECTIONS_PER_CLIENT": "1000", "KVCHAT_MAX_CONNECTIONS_PER_TENANT": "1000",
        # NOTE: one secret for both workers: a second worker with another one refuses to start (issue 45)
        "KVCHAT_SECRET_KEY": "kvchat-agent-fanout-bench-secret",
    }  # fmt: skip
    log = workdir / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"], cwd=REPO_ROOT, env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"worker {name} exited: see {log}")
            try:
                if httpx.get(f"{url}/livez", timeout=5).json().get("phase") == "ready":
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"worker {name} was not ready within 300 s: see {log}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A new, empty database for the run (dropped afterwards); yields its SQLAlchemy URL."""
    name = f"kvchat_agent_bench_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        base = admin_url.rsplit("/", 1)[0]
        yield f"{base.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


class Arrivals:
    """How many agent messages reached any customer; ``all_in`` is set once ``expected`` did."""

    def __init__(self) -> None:
        self.count = 0
        self.expected: int | None = None
        self.all_in = asyncio.Event()

    def one(self) -> None:
        self.count += 1
        if self.expected is not None and self.count >= self.expected:
            self.all_in.set()


class Customer:
    """One customer socket: records when each agent message arrived."""

    def __init__(self, ws: Any, session_id: str) -> None:
        self.ws = ws
        self.session_id = session_id
        self.received: list[tuple[str, float]] = []
        self.fanout_ms: dict[str, float] = {}  # text -> created_at to received

    async def read(self, arrivals: Arrivals) -> None:
        async for raw in self.ws:
            frame = json.loads(raw)
            if frame["type"] == "agent.message":
                now, wall = time.monotonic(), time.time()
                created = datetime.fromisoformat(frame["created_at"]).timestamp()
                self.received.append((frame["text"], now))
                self.fanout_ms[frame["text"]] = 1000 * (wall - created)
                arrivals.one()


async def _open_customer(ws_url: str) -> Customer:
    ws = await websockets.connect(ws_url, max_queue=None)
    await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
    welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": "ask", "text": "I want to talk to a person"}))
    while json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))["type"] != "session.queue":
        pass
    return Customer(ws, welcome["session_id"])


async def scenario(
    customers_url: str, agents_url: str, keys: list[str], args: argparse.Namespace, tag: str
) -> dict[str, Any]:
    ws_url = customers_url.replace("http://", "ws://") + "/ws/chat"
    customers = [await _open_customer(ws_url) for _ in range(args.customers)]
    arrivals = Arrivals()
    readers = [asyncio.create_task(c.read(arrivals)) for c in customers]
    limits = httpx.Limits(max_connections=len(keys) * 2)
    async with httpx.AsyncClient(base_url=agents_url, limits=limits, timeout=TIMEOUT_S) as http:
        owned: list[list[Customer]] = [[] for _ in keys]
        for i, c in enumerate(customers):
            claimed = await http.post(
                f"/inbox/{c.session_id}/claim", headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}
            )
            claimed.raise_for_status()
            owned[i % len(keys)].append(c)
        sent: dict[str, tuple[Customer, float]] = {}

        async def agent(n: int) -> None:
            headers = {"Authorization": f"Bearer {keys[n]}"}
            for m in range(args.messages // len(keys)):
                target = owned[n][m % len(owned[n])]
                text = f"{tag}-{n}-{m} Thanks for waiting; your parcel is on its way."
                sent[text] = (target, time.monotonic())
                (
                    await http.post(f"/inbox/{target.session_id}/messages", headers=headers, json={"text": text})
                ).raise_for_status()
                await asyncio.sleep(args.interval_ms / 1000)

        started = time.monotonic()
        await asyncio.gather(*(agent(n) for n in range(len(keys))))
        wall_s = time.monotonic() - started
    arrivals.expected = len(sent)
    if arrivals.count >= len(sent):
        arrivals.all_in.set()
    with contextlib.suppress(TimeoutError):  # (what has not arrived 10 s after the last send is lost)
        await asyncio.wait_for(arrivals.all_in.wait(), 10)
    for c in customers:
        await c.ws.close()
    for task in readers:
        task.cancel()
    latencies, fanout, misrouted = [], [], 0
    counts = Counter(text for c in customers for text, _ in c.received)
    for c in customers:
        for text, at in c.received:
            target, t0 = sent.get(text, (None, 0.0))
            if target is not c:
                misrouted += 1
            elif counts[text] == 1:
                latencies.append(1000 * (at - t0))
                fanout.append(c.fanout_ms[text])
    lost = sum(1 for text in sent if counts[text] == 0)
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    return {
        "messages": len(sent),
        "received": len(latencies),
        "lost": lost,
        "duplicated": duplicated,
        "misrouted": misrouted,
        "wall_s": round(wall_s, 2),
        "fanout_ms": _quantiles(fanout),
        "end_to_end_ms": _quantiles(latencies),
    }


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": round(percentile(ordered, 50), 2),
        "p95": round(percentile(ordered, 95), 2),
        "p99": round(percentile(ordered, 99), 2),
        "max": round(ordered[-1], 2),
    }


async def _agents(url: str, count: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
        keys = []
        for n in range(count):
            made = await http.post(
                "/admin/tenant/agents", headers={"X-API-Key": ADMIN_KEY}, json={"name": f"Agent {n}"}
            )
            made.raise_for_status()
            keys.append(made.json()["key"])
        return keys


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from engine.testing import build_tiny_model

    model = build_tiny_model(workdir / "tiny", suppress_eos=True)
    results: dict[str, Any] = {}
    with scratch_database(args.postgres) as url, worker("a", url, model, workdir, migrate=True) as a:
        keys = asyncio.run(_agents(a, args.agents))
        results["one_worker"] = asyncio.run(scenario(a, a, keys, args, "one"))
        with worker("b", url, model, workdir, migrate=False) as b:
            time.sleep(2.0)  # (B's fan-out listens, and its heartbeats are in)
            results["two_workers"] = asyncio.run(scenario(a, b, keys, args, "two"))
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.agent_fanout", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres", help="an admin connection")
    p.add_argument("--customers", type=int, default=50)
    p.add_argument("--agents", type=int, default=5)
    p.add_argument("--messages", type=int, default=1000, help="agent messages per scenario")
    p.add_argument("--interval-ms", type=float, default=100.0, help="each agent's pause between two of its messages")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvchat-agent-fanout-") as workdir:
        scenarios = run(args, Path(workdir))
    targets = {
        name: {
            "fanout_p99_ms": s["fanout_ms"]["p99"],
            "target_p99_ms": TARGETS_P99_MS[name],
            "met": s["fanout_ms"]["p99"] <= TARGETS_P99_MS[name]
            and s["lost"] == s["duplicated"] == s["misrouted"] == 0,
        }
        for name, s in scenarios.items()
    }
    report = {
        "customers": args.customers,
        "agents": args.agents,
        "interval_ms": args.interval_ms,
        "scenarios": scenarios,
        "targets": targets,
        "command": "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.agent_fanout", sys.argv[1:]),
        "machine": machine_info(dtype="float32"),
    }
    headers = [
        "scenario",
        "latency",
        "messages",
        "lost",
        "dup",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "target",
        "met",
    ]
    rows = []
    for n, s in scenarios.items():
        for kind in ("fanout_ms", "end_to_end_ms"):
            q = s[kind]
            target = (TARGETS_P99_MS[n], targets[n]["met"]) if kind == "fanout_ms" else ("", "")
            rows.append([n, kind[:-3], s["messages"], s["lost"], s["duplicated"], q["p50"], q["p95"], q["p99"],
                         q["max"], *target])  # fmt: skip
    print(format_table(headers, rows))
    write_json(args.out, report)
    print(f"wrote {args.out}\nreproduce: {report['command']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
