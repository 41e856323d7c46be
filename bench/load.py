"""The load program (issue 20): closed-loop websocket clients against a real ``kvchat serve`` at 1×, 2×, 3× capacity.

Reproduce the committed figures (docs/benchmarks/load.json):

    .venv/bin/python -m bench.load --model tiny --seqs 4 --waiting 4 --duration 20

**Capacity** C = ``max_num_seqs + max_waiting``: the requests the engine holds at once (running + queued). A level k
runs k·C clients of one tenant; the tenant's socket cap is 2C (``KVCHAT_MAX_CONNECTIONS_PER_TENANT``). So at 1× every
client holds a socket and the engine is full; at 2× every client holds a socket and the engine refuses what is over
its queue (``busy`` error frames); at 3× a third of the clients are refused at the socket cap (close 1013) as well.

Each client is a closed loop: connect and send ``hello`` (a 1013 close: wait ``--retry-ms``, connect again); then
send a message, wait for ``message.completed`` (a ``busy`` frame: wait its ``retry_after_ms``, re-send the same
``client_msg_id``), think 0..``--think-ms`` ms, repeat, until the level's time is up. Measured per level: held sockets
(the most at once), completed messages/s, first-delta latency (send → first ``message.delta``) p50/p99, refusals
(1013 closes and ``busy`` frames) and their latency (1013: from the start of the connect to the close; busy: from the
send to the error frame; a re-sent message's first delta counts from the send that was accepted), and the server
process's peak RSS per level (sampled from /proc every 100 ms) and its RSS at the level's end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
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
from websockets.asyncio.client import ClientConnection

from bench.metrics import Stat
from bench.runners.kvchat_ws import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "load.json"
CHAT_TOKEN = "load-chat-token"
TRY_AGAIN_LATER = 1013
_TURN_TIMEOUT_S = 120.0
_TEXTS = (
    "Hello, my order has not arrived yet. Can you check it?",
    "I would like a refund for a damaged item.",
    "How long does express shipping take?",
    "Please reset my password, I cannot log in.",
)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    model: str  # "tiny" (built here), "smollm2", a safetensors folder or a .gguf file
    seqs: int
    waiting: int
    levels: tuple[int, ...]
    duration_s: float
    think_ms: float
    max_tokens: int
    retry_ms: float
    grace_s: float
    seed: int

    @property
    def capacity(self) -> int:
        return self.seqs + self.waiting

    @property
    def tenant_cap(self) -> int:
        return 2 * self.capacity


@dataclass(slots=True)
class LevelRecorder:
    """What the clients of one level saw (appended from one event loop: no locks)."""

    held_now: int = 0
    held_max: int = 0
    completed: int = 0
    first_delta_s: list[float] = field(default_factory=list)
    refused_1013_s: list[float] = field(default_factory=list)
    refused_busy_s: list[float] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)

    def hold(self, delta: int) -> None:
        self.held_now += delta
        self.held_max = max(self.held_max, self.held_now)


@dataclass(frozen=True, slots=True)
class LevelResult:
    multiplier: int
    clients: int
    held_sockets_max: int
    wall_s: float
    messages_completed: int
    messages_per_s: float
    first_delta_s: Stat
    refused_1013: int
    refused_1013_s: Stat
    refused_busy: int
    refused_busy_s: Stat
    other_errors: int
    first_other_error: str | None
    server_peak_rss_mib: float
    server_rss_end_mib: float


# ---------------------------------------------------------------------------------------------------- the server


@dataclass(slots=True)
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat"

    def rss_mib(self) -> float:
        """Resident memory of the server process (VmRSS), in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc/<pid>/status")


def server_env(config: LoadConfig, model_path: str, data_dir: Path, database_url: str | None = None) -> dict[str, str]:
    """The server's settings; ``database_url``: its database (default: a SQLite file in ``data_dir``)."""
    tiny = config.model == "tiny"
    return {
        "KVCHAT_MODEL": model_path,
        "KVCHAT_ENGINE_DEVICE": "cpu",
        "KVCHAT_ENGINE_DTYPE": "float32" if tiny else "auto",
        "KVCHAT_MAX_KV_MEMORY_MB": "64" if tiny else "512",
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_DATABASE_URL": database_url or f"sqlite:///{data_dir / 'kvchat.db'}",
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": CHAT_TOKEN,
        "KVCHAT_BOOTSTRAP_ADMIN_KEY": "load-admin-key",
        "KVCHAT_MAX_NUM_SEQS": str(config.seqs),
        "KVCHAT_MAX_WAITING": str(config.waiting),
        "KVCHAT_MAX_CONNECTIONS_PER_TENANT": str(config.tenant_cap),
        "KVCHAT_REPLY_MAX_TOKENS": str(config.max_tokens),
        # NOTE: the frame rate limit is not what this program measures: every client sends one frame per turn.
        "KVCHAT_WS_RATE_PER_SECOND": "1000",
        "KVCHAT_WS_RATE_BURST": "1000",
        "KVCHAT_LOG_LEVEL": "warning",
    }


@contextmanager
def running_server(config: LoadConfig, workdir: Path, database_url: str | None = None) -> Iterator[Server]:
    """``kvchat serve`` as a subprocess (so its memory and GIL are its own), stopped with SIGTERM afterwards."""
    model_path = config.model
    if config.model == "tiny":
        from engine.testing import build_tiny_model

        model_path = str(build_tiny_model(workdir / "tiny-model", suppress_eos=True))
    port = free_port()
    listen = {"KVCHAT_HOST": "127.0.0.1", "KVCHAT_PORT": str(port)}
    env = os.environ | server_env(config, model_path, workdir, database_url) | listen
    log_path = workdir / "server.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=log
        )
    server = Server(proc, port, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _wait_ready(server: Server, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"kvchat serve exited ({server.proc.returncode}):\n{server.log_path.read_text()[-3000:]}"
            )
        try:
            # NOTE: /readyz, not /livez: the server listens while it loads its model (/livez answers at once)
            if httpx.get(f"http://127.0.0.1:{server.port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"kvchat serve was not ready (/readyz) in {timeout_s:.0f}s")


class RssSampler:
    """The server's RSS every 100 ms on a thread; ``peak()`` since the last ``reset()``."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def reset(self) -> None:
        self._peak = self.server.rss_mib()

    def peak(self) -> float:
        return max(self._peak, self.server.rss_mib())

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._peak = max(self._peak, self.server.rss_mib())
            except (OSError, RuntimeError):
                return  # the process is gone


# ---------------------------------------------------------------------------------------------------- one client


@dataclass(slots=True)
class Client:
    index: int
    url: str
    config: LoadConfig
    record: LevelRecorder
    deadline: float  # loop clock: no new connect or message after this
    rng: random.Random

    async def run(self) -> None:
        """Connect (again after each 1013) until welcomed, then converse until the deadline."""
        ws = await self._connect_until_welcomed()
        if ws is None:
            return
        self.record.hold(+1)
        try:
            await self._converse(ws)
        finally:
            self.record.hold(-1)
            await ws.close()

    async def _connect_until_welcomed(self) -> ClientConnection | None:
        loop = asyncio.get_running_loop()
        while loop.time() < self.deadline:
            ws = await self._connect()
            if ws is not None:
                return ws
            await asyncio.sleep(self.config.retry_ms / 1000)
        return None

    async def _connect(self) -> ClientConnection | None:
        """A welcomed socket, or None when the server refused it (a 1013 close is recorded with its latency)."""
        start = time.perf_counter()
        hello = json.dumps({"type": "hello", "token": CHAT_TOKEN, "external_ref": f"load-client-{self.index}"})
        try:
            ws = await websockets.connect(self.url, open_timeout=60, max_size=2**22)
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            self.record.other_errors.append(f"connect failed: {type(exc).__name__}: {exc}")
            return None
        try:
            await ws.send(hello)
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
        except websockets.ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else None
            if code == TRY_AGAIN_LATER:
                self.record.refused_1013_s.append(time.perf_counter() - start)
            else:
                self.record.other_errors.append(f"hello closed with {code}")
            return None
        if frame.get("type") != "welcome":
            self.record.other_errors.append(f"hello answered with {frame}")
            await ws.close()
            return None
        return ws

    async def _converse(self, ws: ClientConnection) -> None:
        loop = asyncio.get_running_loop()
        turn = 0
        while loop.time() < self.deadline:
            turn += 1
            try:
                if not await self._turn(ws, f"c{self.index}-t{turn}", self.rng.choice(_TEXTS)):
                    return
            except TimeoutError:
                self.record.other_errors.append(f"no reply within {_TURN_TIMEOUT_S:.0f}s")
                return
            await asyncio.sleep(self.rng.uniform(0, self.config.think_ms) / 1000)

    async def _turn(self, ws: ClientConnection, client_msg_id: str, text: str) -> bool:
        """One message until its reply completed (re-sent after each busy refusal); False when the socket is done."""
        message = json.dumps({"type": "user.message", "client_msg_id": client_msg_id, "text": text})
        async with asyncio.timeout(_TURN_TIMEOUT_S):
            sent = time.perf_counter()
            await ws.send(message)
            first_delta = True
            while True:
                try:
                    frame = json.loads(await ws.recv())
                except websockets.ConnectionClosed as closed:
                    self.record.other_errors.append(f"socket closed mid-turn ({closed.rcvd})")
                    return False
                kind = frame.get("type")
                if kind == "message.delta" and first_delta:
                    self.record.first_delta_s.append(time.perf_counter() - sent)
                    first_delta = False
                elif kind == "message.completed":
                    self.record.completed += 1
                    return True
                elif kind == "error" and frame.get("code") == "busy":
                    self.record.refused_busy_s.append(time.perf_counter() - sent)
                    if asyncio.get_running_loop().time() >= self.deadline:
                        return False
                    await asyncio.sleep((frame.get("retry_after_ms") or self.config.retry_ms) / 1000)
                    sent = time.perf_counter()
                    await ws.send(message)  # NOTE: the same client_msg_id: the stored message is answered, once
                elif kind == "error":
                    self.record.other_errors.append(f"{frame.get('code')}: {frame.get('message')}")
                    return False


# ---------------------------------------------------------------------------------------------------- levels


async def _progress(record: LevelRecorder, label: str, start: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(2.0)
        print(
            f"  {label} {time.monotonic() - start:5.1f}s: held {record.held_now}, done {record.completed},"
            f" refused 1013 {len(record.refused_1013_s)} / busy {len(record.refused_busy_s)}",
            flush=True,
        )


async def run_level(server: Server, config: LoadConfig, multiplier: int, rss: RssSampler) -> LevelResult:
    clients = multiplier * config.capacity
    record = LevelRecorder()
    rng = random.Random(config.seed * 1000 + multiplier)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.duration_s
    rss.reset()
    start = time.monotonic()
    stop = asyncio.Event()
    progress = asyncio.create_task(_progress(record, f"{multiplier}x", start, stop))
    tasks = [Client(i, server.ws, config, record, deadline, random.Random(rng.random())).run() for i in range(clients)]
    try:
        async with asyncio.timeout(config.duration_s + config.grace_s + _TURN_TIMEOUT_S):
            await asyncio.gather(*tasks)
    finally:
        stop.set()
        progress.cancel()
    wall = time.monotonic() - start
    return LevelResult(
        multiplier=multiplier,
        clients=clients,
        held_sockets_max=record.held_max,
        wall_s=round(wall, 3),
        messages_completed=record.completed,
        messages_per_s=round(record.completed / wall, 3),
        first_delta_s=Stat.of(record.first_delta_s),
        refused_1013=len(record.refused_1013_s),
        refused_1013_s=Stat.of(record.refused_1013_s),
        refused_busy=len(record.refused_busy_s),
        refused_busy_s=Stat.of(record.refused_busy_s),
        other_errors=len(record.other_errors),
        first_other_error=record.other_errors[0] if record.other_errors else None,
        server_peak_rss_mib=round(rss.peak(), 1),
        server_rss_end_mib=round(server.rss_mib(), 1),
    )


async def run_levels(server: Server, config: LoadConfig) -> list[LevelResult]:
    results = []
    with RssSampler(server) as rss:
        for multiplier in config.levels:
            print(
                f"level {multiplier}x: {multiplier * config.capacity} clients for {config.duration_s:.0f}s", flush=True
            )
            results.append(await run_level(server, config, multiplier, rss))
            # NOTE: a pause between levels: replies abandoned at the deadline finish before the next level starts.
            await asyncio.sleep(min(config.grace_s, 2.0))
    return results


# ---------------------------------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def table(config: LoadConfig, results: Sequence[LevelResult]) -> str:
    head = (
        f"capacity C = max_num_seqs {config.seqs} + max_waiting {config.waiting} = {config.capacity};"
        f" socket cap per tenant {config.tenant_cap}; model {config.model}; {config.max_tokens} tokens a reply"
    )
    cols = (
        "level | clients | held | msg/s | first delta p50 / p99 ms | 1013 | 1013 p50 / p99 ms | busy | "
        "busy p50 / p99 ms | other errors | server RSS peak / end MiB"
    )
    rows = [
        f"{r.multiplier}x | {r.clients} | {r.held_sockets_max} | {r.messages_per_s:.2f} | "
        f"{_ms(r.first_delta_s.p50)} / {_ms(r.first_delta_s.p99)} | {r.refused_1013} | "
        f"{_ms(r.refused_1013_s.p50)} / {_ms(r.refused_1013_s.p99)} | {r.refused_busy} | "
        f"{_ms(r.refused_busy_s.p50)} / {_ms(r.refused_busy_s.p99)} | {r.other_errors} | "
        f"{r.server_peak_rss_mib:.0f} / {r.server_rss_end_mib:.0f}"
        for r in results
    ]
    return "\n".join([head, cols, "-" * len(cols), *rows])


def write_json(path: Path, config: LoadConfig, command: str, results: Sequence[LevelResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "command": command,
        "config": asdict(config) | {"capacity": config.capacity, "tenant_cap": config.tenant_cap},
        "cpu_count": os.cpu_count(),
        "levels": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (a random test model, built here), smollm2, or a path")
    p.add_argument("--seqs", type=int, default=4, help="KVCHAT_MAX_NUM_SEQS")
    p.add_argument("--waiting", type=int, default=4, help="KVCHAT_MAX_WAITING")
    p.add_argument("--levels", default="1,2,3", help="multiples of the capacity, comma list")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    p.add_argument("--think-ms", type=float, default=200.0, help="a client thinks 0..this many ms between messages")
    p.add_argument("--max-tokens", type=int, default=32, help="KVCHAT_REPLY_MAX_TOKENS")
    p.add_argument("--retry-ms", type=float, default=250.0, help="wait after a 1013 before connecting again")
    p.add_argument("--grace", type=float, default=10.0, help="seconds past a level's end for its last turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON result")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = LoadConfig(
        model=args.model,
        seqs=args.seqs,
        waiting=args.waiting,
        levels=tuple(int(x) for x in args.levels.split(",")),
        duration_s=args.duration,
        think_ms=args.think_ms,
        max_tokens=args.max_tokens,
        retry_ms=args.retry_ms,
        grace_s=args.grace,
        seed=args.seed,
    )
    command = shlex.join([".venv/bin/python", "-m", "bench.load", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="kvchat-load-") as tmp, running_server(config, Path(tmp)) as server:
        print(f"kvchat serve (pid {server.proc.pid}) on port {server.port}; {command}", flush=True)
        results = asyncio.run(run_levels(server, config))
    print(table(config, results))
    write_json(args.out, config, command, results)
    print(f"wrote {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
