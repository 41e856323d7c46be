"""Hardening figures (issue 28) against a real ``kvchat serve`` process: refusals under a burst, fairness between
tenants, ``/livez`` while huge prompts are tokenized.

Four measurements, each against its control in the same run:

- **hellos**: ``--hellos`` websockets say hello at once to a tenant capped at ``--cap`` sockets: the latency of each
  1013 refusal and of each welcome (control: one hello alone), and the server's RSS before, at the peak, and after
  the sockets closed.
- **streams**: ``--streams`` ``/v1/chat/completions`` streams at once against an engine that queues
  ``max_num_seqs + max_waiting`` of them: the latency of each 503 (control: one request alone).
- **fairness**: tenant B's turn alone, beside tenant A's 10,000-character message of a's (the control: what such a
  message costs anyway, mostly its prefill in the engine), and beside the same message when A's rule is ``(a+)+$``:
  B's ack, first delta and completion, and A's.
- **livez**: ``/livez`` sampled every 10 ms, idle (control) and while four threads send 0.4 MB bracket prompts to
  ``/v1`` (tokenized: their length alone does not prove them too long).

The model is a tiny random one built here (its context raised to 32k so the 10,000-character message fits), so the
figures measure the server, not the model. Prints a table, writes JSON (``--out``)::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.hardening \\
        --database-url postgresql://postgres@127.0.0.1:5432/kvchat_hardening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.load import REPO_ROOT
from bench.runners.kvchat_ws import free_port

CHAT_TOKEN = "hardening-chat-token"
ADMIN_KEY = "hardening-admin-key"
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "hardening.json"
TRY_AGAIN_LATER = 1013
TIMEOUT_S = 120.0
HOSTILE = "a" * 9_999 + "!"  # 10,000 characters: exponential for (a+)+$ on a backtracking engine
REDOS_RULE = {"name": "redos", "pattern": "(a+)+$", "block_type": "identifier", "priority": 1}
VICTIM_TEXT = "Where is my parcel? It was due on Monday."
BRACKETS = "[" * 200_000 + "]" * 200_000  # 0.4 MB: under the tiny model's length-only floor (13 chars a token at most)


@dataclass(frozen=True, slots=True)
class Config:
    database_url: str
    hellos: int = 300
    cap: int = 200
    streams: int = 400
    seqs: int = 32
    waiting: int = 256
    fairness_rounds: int = 5
    livez_samples: int = 300


@dataclass(slots=True)
class Latencies:
    """Seconds, with their p50 / p99 / max."""

    values: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | None]:
        v = sorted(self.values)
        if not v:
            return {"n": 0, "p50": None, "p99": None, "max": None}
        p99 = statistics.quantiles(v, n=100, method="inclusive")[98] if len(v) > 1 else v[0]
        return {"n": len(v), "p50": statistics.median(v), "p99": p99, "max": v[-1]}


# ---------------------------------------------------------------------------------------------------- the server


@dataclass(slots=True)
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat"

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc/<pid>/status")


def server_env(config: Config, model_dir: Path, data_dir: Path) -> dict[str, str]:
    return {
        "KVCHAT_DATABASE_URL": config.database_url,
        "KVCHAT_MODEL": str(model_dir),
        "KVCHAT_ENGINE_DEVICE": "cpu",
        "KVCHAT_ENGINE_DTYPE": "float32",
        "KVCHAT_MAX_KV_MEMORY_MB": "64",
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": CHAT_TOKEN,
        "KVCHAT_BOOTSTRAP_ADMIN_KEY": ADMIN_KEY,
        "KVCHAT_MAX_NUM_SEQS": str(config.seqs),
        "KVCHAT_MAX_WAITING": str(config.waiting),
        "KVCHAT_MAX_CONNECTIONS_PER_TENANT": str(config.cap),
        "KVCHAT_MAX_CONNECTIONS_PER_CLIENT": str(config.hellos),
        "KVCHAT_REPLY_MAX_TOKENS": "8",
        "KVCHAT_WS_RATE_PER_SECOND": "1000",
        "KVCHAT_WS_RATE_BURST": "1000",
        "KVCHAT_KV_DISK_CACHE": "false",
        "KVCHAT_LOG_LEVEL": "warning",
    }


@contextmanager
def running_server(config: Config, workdir: Path) -> Iterator[Server]:
    """``kvchat serve`` as a subprocess (its memory and GIL its own), stopped with SIGTERM afterwards."""
    from engine.testing import build_tiny_model

    model_dir = build_tiny_model(workdir / "tiny-model", suppress_eos=True, max_position_embeddings=32_768)
    port = free_port()
    env = os.environ | server_env(config, model_dir, workdir) | {"KVCHAT_HOST": "127.0.0.1", "KVCHAT_PORT": str(port)}
    log_path = workdir / "server.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=log
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


def wait_ready(server: Server, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"kvchat serve exited ({server.proc.returncode}):\n{server.log_path.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{server.http}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"kvchat serve was not ready (/readyz) in {timeout_s:.0f}s")


# ---------------------------------------------------------------------------------------------------- hellos


@dataclass(slots=True)
class HelloBurst:
    welcomed: Latencies = field(default_factory=Latencies)
    refused: Latencies = field(default_factory=Latencies)
    reasons: dict[str, int] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)


async def hello_burst(ws_url: str, count: int, token: str = CHAT_TOKEN) -> HelloBurst:
    """``count`` sockets are opened, then all say hello at once; the welcomed ones are held until every answer is in,
    then closed. Each latency runs from the hello to the welcome or the close."""
    result = HelloBurst()
    held: list[Any] = []
    ready = 0
    all_ready, go = asyncio.Event(), asyncio.Event()

    async def one(i: int) -> None:
        nonlocal ready
        try:
            ws = await websockets.connect(ws_url, open_timeout=TIMEOUT_S, max_size=2**22)
        finally:
            ready += 1
            if ready == count:
                all_ready.set()
        await go.wait()
        start = time.perf_counter()
        try:
            await ws.send(json.dumps({"type": "hello", "token": token, "external_ref": f"burst-{i}"}))
            frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        except websockets.ConnectionClosed as closed:
            code, reason = (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd is not None else (None, "")
            if code == TRY_AGAIN_LATER:
                result.refused.values.append(time.perf_counter() - start)
                result.reasons[reason] = result.reasons.get(reason, 0) + 1
            else:
                result.other.append(f"closed {code} {reason}")
            return
        if frame.get("type") == "welcome":
            result.welcomed.values.append(time.perf_counter() - start)
            held.append(ws)
        else:
            result.other.append(f"answered {frame.get('type')}")
            await ws.close()

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    await asyncio.wait_for(all_ready.wait(), TIMEOUT_S)
    go.set()
    await asyncio.gather(*tasks)
    await asyncio.gather(*(ws.close() for ws in held))
    return result


# ---------------------------------------------------------------------------------------------------- streams


@dataclass(slots=True)
class StreamBurst:
    streamed: Latencies = field(default_factory=Latencies)  # to the 200's status line
    refused: Latencies = field(default_factory=Latencies)  # to the 503
    other: dict[str, int] = field(default_factory=dict)


def _completion(stream: bool, content: str = "Hello there, how are you?") -> dict[str, Any]:
    return {"model": "default", "stream": stream, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


async def stream_burst(http_url: str, count: int, token: str = CHAT_TOKEN) -> StreamBurst:
    """``count`` connections are opened, then each sends a streaming completion at once; each latency runs from its
    request's first byte to its status line.

    NOTE: raw sockets, not an HTTP client: a client library spends milliseconds of its own loop per request, which
    a burst of 400 would add to every latency it measures.
    """
    result = StreamBurst()
    url = httpx.URL(http_url)
    body = json.dumps(_completion(True)).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    ready = 0
    all_ready, go = asyncio.Event(), asyncio.Event()

    async def one() -> None:
        nonlocal ready
        try:
            reader, writer = await asyncio.open_connection(url.host, url.port)
        finally:
            ready += 1
            if ready == count:
                all_ready.set()
        await go.wait()
        start = time.perf_counter()
        writer.write(request)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
        elapsed = time.perf_counter() - start
        await asyncio.wait_for(reader.read(), TIMEOUT_S)  # (to the end: the server closes after the response)
        writer.close()
        status = status_line.split(b" ")[1].decode() if status_line.count(b" ") >= 2 else "no answer"
        if status == "200":
            result.streamed.values.append(elapsed)
        elif status == "503":
            result.refused.values.append(elapsed)
        else:
            result.other[status] = result.other.get(status, 0) + 1

    async with httpx.AsyncClient(base_url=http_url, timeout=TIMEOUT_S) as client:
        await one_request(client, {"Authorization": f"Bearer {token}"})  # (warm: the first request loads things)
    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await asyncio.wait_for(all_ready.wait(), TIMEOUT_S)
    go.set()
    await asyncio.gather(*tasks)
    return result


async def one_request(client: httpx.AsyncClient, headers: dict[str, str]) -> float:
    start = time.perf_counter()
    response = await client.post("/v1/chat/completions", headers=headers, json=_completion(False))
    response.raise_for_status()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- fairness


PHASES = ("message.ack", "message.delta", "message.completed")


@dataclass(slots=True)
class Turns:
    """One side's turns: seconds from the send to its ack, its first delta, its last frame (completed, or error)."""

    ack: Latencies = field(default_factory=Latencies)
    first_delta: Latencies = field(default_factory=Latencies)
    done: Latencies = field(default_factory=Latencies)
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, phases: dict[str, float], outcome: str) -> None:
        for name, into in zip(PHASES, (self.ack, self.first_delta, self.done), strict=True):
            if name in phases:
                into.values.append(phases[name])
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {
            "ack": self.ack.summary(),
            "first_delta": self.first_delta.summary(),
            "done": self.done.summary(),
            "outcomes": self.outcomes,
        }


@dataclass(slots=True)
class Fairness:
    """Tenant B's turns alone, beside tenant A's 10,000-character message when A has no rule (the control: what a
    long message costs anyway, in the engine), and beside the same message when A's rule is ``(a+)+$``."""

    alone: Turns = field(default_factory=Turns)
    beside_plain: Turns = field(default_factory=Turns)
    beside_redos: Turns = field(default_factory=Turns)
    plain: Turns = field(default_factory=Turns)  # A's message, no rule
    redos: Turns = field(default_factory=Turns)  # A's message, with the ReDoS rule


async def add_tenant(database_url: str, name: str) -> tuple[str, str]:
    """A tenant made directly in the database (as ``kvchat tenants create`` does): its chat token and admin key."""
    from backend.core.config import normalize_database_url
    from backend.db.engine import create_db_engine, create_sessionmaker
    from backend.domain import KeyKind
    from backend.services import tenants

    engine = create_db_engine(normalize_database_url(database_url))
    try:
        async with create_sessionmaker(engine)() as db:
            tenant = await tenants.create_tenant(db, name)
            chat = await tenants.issue_key(db, tenant.id, KeyKind.CHAT)
            admin = await tenants.issue_key(db, tenant.id, KeyKind.ADMIN)
            await db.commit()
    finally:
        await engine.dispose()
    return chat.key, admin.key


async def _session(ws_url: str, token: str) -> Any:
    ws = await websockets.connect(ws_url, open_timeout=TIMEOUT_S, max_size=2**22)
    await ws.send(json.dumps({"type": "hello", "token": token}))
    welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    if welcome.get("type") != "welcome":
        raise RuntimeError(f"hello answered with {welcome}")
    return ws


async def timed_turn(ws: Any, text: str, msg_id: str) -> tuple[dict[str, float], str]:
    """Send ``text``; the seconds to each of its frames (first of each kind) and how it ended (reply, or error)."""
    start = time.perf_counter()
    phases: dict[str, float] = {}
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": text}))
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        phases.setdefault(frame["type"], time.perf_counter() - start)
        if frame["type"] == "message.completed":
            return phases, "reply"
        if frame["type"] == "error":
            phases["message.completed"] = phases["error"]
            return phases, f"error {frame['code']}"


async def _beside(victim: Any, attacker: Any, n: str, into: Turns, attack_into: Turns) -> None:
    attack = asyncio.create_task(timed_turn(attacker, HOSTILE, f"attack-{n}"))
    await asyncio.sleep(0.005)  # (A's message is in first)
    into.add(*await timed_turn(victim, VICTIM_TEXT, f"beside-{n}"))
    attack_into.add(*await attack)


async def fairness(server: Server, database_url: str, rounds: int) -> Fairness:
    """``rounds`` of: B alone, B beside A's message without a rule, B beside it with A's ReDoS rule."""
    result = Fairness()
    tag = time.time_ns()
    plain_token, _ = await add_tenant(database_url, f"plain-{tag}")
    redos_token, redos_admin = await add_tenant(database_url, f"redos-{tag}")
    victim_token, _ = await add_tenant(database_url, f"victim-{tag}")
    async with httpx.AsyncClient(base_url=server.http, timeout=TIMEOUT_S) as http:
        made = await http.post("/admin/rules", headers={"X-API-Key": redos_admin}, json=REDOS_RULE)
        made.raise_for_status()
    for n in range(rounds):
        victim = await _session(server.ws, victim_token)
        plain = await _session(server.ws, plain_token)
        redos = await _session(server.ws, redos_token)
        try:
            await timed_turn(victim, "hello", f"warm-{n}")
            result.alone.add(*await timed_turn(victim, VICTIM_TEXT, f"alone-{n}"))
            await _beside(victim, plain, f"plain-{n}", result.beside_plain, result.plain)
            await _beside(victim, redos, f"redos-{n}", result.beside_redos, result.redos)
        finally:
            for ws in (victim, plain, redos):
                await ws.close()
    return result


# ---------------------------------------------------------------------------------------------------- livez


def livez_latencies(http_url: str, samples: int, interval_s: float = 0.01) -> Latencies:
    """``/livez`` on a fixed schedule; each latency counts from when the request was due (no coordinated omission)."""
    result = Latencies()
    with httpx.Client(base_url=http_url, timeout=TIMEOUT_S) as client:
        start = time.perf_counter()
        for i in range(samples):
            due = start + i * interval_s
            time.sleep(max(0.0, due - time.perf_counter()))
            client.get("/livez").raise_for_status()
            result.values.append(time.perf_counter() - due)
    return result


@contextmanager
def bracket_load(http_url: str, threads: int = 4) -> Iterator[dict[str, int]]:
    """``threads`` threads sending 0.4 MB bracket prompts to ``/v1`` until the block ends; yields their statuses."""
    stop = threading.Event()
    statuses: dict[str, int] = {}
    lock = threading.Lock()
    body = json.dumps(_completion(False, BRACKETS)).encode()
    headers = {"Authorization": f"Bearer {CHAT_TOKEN}", "content-type": "application/json"}

    def run() -> None:
        with httpx.Client(base_url=http_url, timeout=TIMEOUT_S) as client:
            while not stop.is_set():
                status = str(client.post("/v1/chat/completions", headers=headers, content=body).status_code)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

    workers = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # (every thread has a request in)
    try:
        yield statuses
    finally:
        stop.set()
        for worker in workers:
            worker.join(TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------- the run


def run(config: Config, workdir: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with running_server(config, workdir) as server:
        solo = asyncio.run(hello_burst(server.ws, 1))
        rss_start = server.rss_mib()
        burst = asyncio.run(hello_burst(server.ws, config.hellos))
        rss_peak = server.rss_mib()
        time.sleep(3.0)  # (the server closes its side, the sweeper and GC run)
        rss_end = server.rss_mib()
        report["hellos"] = {
            "control_welcome": solo.welcomed.summary(),
            "welcomed": burst.welcomed.summary(),
            "refused_1013": burst.refused.summary(),
            "reasons": burst.reasons,
            "other": burst.other,
            "rss_mib": {"start": rss_start, "peak": rss_peak, "end": rss_end},
        }
        alone = asyncio.run(stream_burst(server.http, 1))
        streams = asyncio.run(stream_burst(server.http, config.streams))
        report["streams"] = {
            "control_stream": alone.streamed.summary(),
            "streamed": streams.streamed.summary(),
            "refused_503": streams.refused.summary(),
            "other": streams.other,
            "capacity": config.seqs + config.waiting,
        }
        fair = asyncio.run(fairness(server, config.database_url, config.fairness_rounds))
        report["fairness"] = {name: getattr(fair, name).summary() for name in Fairness.__dataclass_fields__}
        idle = livez_latencies(server.http, config.livez_samples)
        with bracket_load(server.http) as statuses:
            loaded = livez_latencies(server.http, config.livez_samples)
        report["livez"] = {"idle": idle.summary(), "brackets": loaded.summary(), "bracket_statuses": statuses}
        report["server_log_tracebacks"] = server.log_path.read_text(errors="replace").count("Traceback")
    return report


def _ms(value: float | int | None) -> str:
    return "-" if value is None else f"{float(value) * 1000:.1f}"


def _row(name: str, s: dict[str, Any], control: dict[str, Any] | None = None) -> str:
    ratio = ""
    if control is not None and control.get("p50") and s.get("p50") is not None:
        ratio = f"{s['p50'] / control['p50']:.2f}x"
    return f"{name:<34} {s['n']:>5} {_ms(s['p50']):>9} {_ms(s['p99']):>9} {_ms(s['max']):>9} {ratio:>8}"


def table(report: dict[str, Any]) -> str:
    h, st, f, lz = report["hellos"], report["streams"], report["fairness"], report["livez"]
    rss = h["rss_mib"]
    lines = [
        f"{'measurement':<34} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'p50/ctl':>8}",
        _row("hello alone (control)", h["control_welcome"]),
        _row("hello burst: welcome", h["welcomed"], h["control_welcome"]),
        _row("hello burst: 1013", h["refused_1013"], h["control_welcome"]),
        _row("stream alone (control)", st["control_stream"]),
        _row("stream burst: 200", st["streamed"], st["control_stream"]),
        _row("stream burst: 503", st["refused_503"], st["control_stream"]),
        *(
            _row(f"B {phase}: {label}", f[key][phase], None if key == "alone" else f["alone"][phase])
            for phase in ("ack", "first_delta", "done")
            for key, label in (
                ("alone", "alone"),
                ("beside_plain", "beside A's 10k (no rule)"),
                ("beside_redos", "beside A's 10k + ReDoS rule"),
            )
        ),
        *(
            _row(f"A 10k message {phase}: {label}", f[key][phase], None if key == "plain" else f["plain"][phase])
            for phase in ("ack", "first_delta", "done")
            for key, label in (("plain", "no rule"), ("redos", "ReDoS rule"))
        ),
        _row("/livez idle (control)", lz["idle"]),
        _row("/livez, 4 x 0.4 MB brackets", lz["brackets"], lz["idle"]),
        f"server RSS MiB: start {rss['start']:.1f}, after the burst {rss['peak']:.1f}, 3 s later {rss['end']:.1f}"
        f" (+{rss['end'] - rss['start']:.1f}); A's outcomes {f['plain']['outcomes']} / {f['redos']['outcomes']};"
        f" bracket answers {lz['bracket_statuses']}; tracebacks in the server log: {report['server_log_tracebacks']}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.hardening", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", help="an empty database (migrated at start); default: SQLite in a temp folder")
    p.add_argument("--hellos", type=int, default=300)
    p.add_argument("--cap", type=int, default=200, help="KVCHAT_MAX_CONNECTIONS_PER_TENANT")
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--seqs", type=int, default=32, help="KVCHAT_MAX_NUM_SEQS")
    p.add_argument("--waiting", type=int, default=256, help="KVCHAT_MAX_WAITING")
    p.add_argument("--fairness-rounds", type=int, default=5)
    p.add_argument("--livez-samples", type=int, default=300)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON result")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvchat-hardening-") as tmp:
        workdir = Path(tmp)
        url = args.database_url or f"sqlite:///{workdir / 'kvchat.db'}"
        config = Config(
            url, args.hellos, args.cap, args.streams, args.seqs, args.waiting, args.fairness_rounds, args.livez_samples
        )
        report = run(config, workdir)
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.hardening " + shlex.join(argv or sys.argv[1:])
    print(table(report))
    print(f"\ncommand: {command}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    args.out.write_text(
        json.dumps(data | {"config": asdict(config) | {"database_url": "(see command)"}} | report, indent=2) + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
