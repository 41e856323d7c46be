"""Refusals first (issue 42): how fast a flood is refused, whether the memory comes back, and whether ``/livez`` stays
fast while large bodies arrive, against a real ``kvchat serve`` process with the real model (SmolLM2-135M).

Each measurement runs against the server of this checkout and, with ``--baseline``, against the server of another
checkout (e.g. a ``git archive`` of the commit before the change) with the same client: both servers run at once,
each measurement alternates between them, so a change in the machine's load falls on both alike.

- **hellos**: ``--hellos`` websockets say hello at once to a tenant capped at ``--cap`` sockets (the client measures
  each 1013 from its hello; the control is one hello alone). Then ``--crashed`` sockets say hello and drop their TCP
  connection without a close frame.
- **memory**: the server's RSS every 0.25 s, from before the burst until ``--settle`` seconds after the last socket
  closed (the goal: back within 20 MB of the start).
- **streams**: ``--streams`` ``/v1/chat/completions`` streams at once against an engine that queues ``--seqs`` +
  ``--waiting`` (the client measures each 503 from its first byte).
- **livez**: ``/livez`` every 20 ms beside ``--sessions`` chat sessions sending turns back to back (the control),
  then the same while a client sends 4, 8, 16 and 32 MiB bodies to ``/v1`` in turn.

Prints a table, writes JSON and a PNG (p99s, and RSS over time)::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.refusals \\
        --admin-url postgresql://postgres@127.0.0.1:5432/postgres --baseline /tmp/kvchat-base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
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

from bench import fairness
from bench.agent_fanout import scratch_database
from bench.hardening import Server, hello_burst, livez_latencies, stream_burst
from bench.load import REPO_ROOT
from bench.reporting import machine_info

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "refusals.json"
TOKEN = fairness.CHAT_TOKEN
BODY_MIB = (4, 8, 16, 32)
PARTS = ("hellos", "streams", "livez")
TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Config:
    hellos: int = 300
    cap: int = 200
    crashed: int = 100
    streams: int = 400
    seqs: int = 32
    waiting: int = 256
    settle_s: float = 30.0
    sessions: int = 16
    livez_samples: int = 500
    max_request_mib: int = 40  # KVCHAT_MAX_REQUEST_BYTES: above the largest body, so each is read and parsed
    parts: tuple[str, ...] = PARTS


@dataclass(slots=True)
class RssSampler:
    """The server's RSS (MiB) every ``period_s``, in a thread, with named marks on the same clock."""

    server: Server
    period_s: float = 0.25
    t0: float = field(default_factory=time.perf_counter)
    samples: list[tuple[float, float]] = field(default_factory=list)
    marks: list[tuple[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def mark(self, name: str) -> float:
        self.marks.append((name, time.perf_counter() - self.t0))
        return self.server.rss_mib()

    def run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.server.rss_mib()))
            self._stop.wait(self.period_s)

    @contextmanager
    def running(self) -> Iterator[RssSampler]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()


async def crash_sockets(ws_url: str, count: int) -> int:
    """``count`` sockets say hello, then drop their TCP connection without a close frame; how many were welcomed."""
    socks = await asyncio.gather(*(websockets.connect(ws_url, open_timeout=TIMEOUT_S) for _ in range(count)))
    welcomed = 0
    for i, ws in enumerate(socks):
        await ws.send(json.dumps({"type": "hello", "token": TOKEN, "external_ref": f"crash-{i}"}))
    for ws in socks:
        frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        welcomed += frame.get("type") == "welcome"
    for ws in socks:
        ws.transport.abort()
    return welcomed


def _big_body(mib: int) -> bytes:
    head = b'{"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"a" * (mib * 1024 * 1024 - len(head) - len(tail)) + tail


def _send_bodies(http_url: str, stop: Any, results: Any) -> None:
    """(In a process of its own, so that its copies and sends take nothing from the client's probes.)"""
    bodies = {mib: _big_body(mib) for mib in BODY_MIB}
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    statuses: dict[str, int] = {}
    seconds: dict[str, list[float]] = {}
    with httpx.Client(base_url=http_url, timeout=TIMEOUT_S) as client:
        n = 0
        while not stop.is_set():
            mib = BODY_MIB[n % len(BODY_MIB)]
            start = time.perf_counter()
            try:
                status = str(client.post("/v1/chat/completions", headers=headers, content=bodies[mib]).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            statuses[status] = statuses.get(status, 0) + 1
            seconds.setdefault(f"{mib} MiB", []).append(round(time.perf_counter() - start, 4))
            n += 1
    results.put({"statuses": statuses, "seconds": seconds})


@contextmanager
def body_sender(http_url: str) -> Iterator[dict[str, Any]]:
    """A process sending 4, 8, 16, 32 MiB bodies to ``/v1`` in turn until the block ends; yields (filled at the end)
    their statuses and the seconds each took."""
    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_send_bodies, args=(http_url, stop, results), daemon=True)
    proc.start()
    time.sleep(2.0)  # (the process has started and sends)
    seen: dict[str, Any] = {}
    try:
        yield seen
    finally:
        stop.set()
        seen.update(results.get(timeout=TIMEOUT_S))
        proc.join(TIMEOUT_S)


async def livez_beside_sessions(server: Server, config: Config, bodies: bool) -> dict[str, Any]:
    """``/livez`` (in a thread) while ``config.sessions`` sessions chat back to back, with or without large bodies."""
    sessions = await asyncio.gather(*(fairness.open_session(server.ws, TOKEN) for _ in range(config.sessions)))
    stop, ttfts = asyncio.Event(), list[float]()
    loops = [asyncio.create_task(fairness.closed_loop(ws, f"s{i}", stop, None, ttfts)) for i, ws in enumerate(sessions)]
    await asyncio.sleep(2.0)  # (every session has a turn in)
    result: dict[str, Any] = {}
    try:
        if bodies:
            with body_sender(server.http) as seen:
                lz = await asyncio.to_thread(livez_latencies, server.http, config.livez_samples, 0.02)
            result["bodies"] = seen
        else:
            lz = await asyncio.to_thread(livez_latencies, server.http, config.livez_samples, 0.02)
    finally:
        stop.set()
        await asyncio.gather(*loops)
        await asyncio.gather(*(ws.close() for ws in sessions))
    return result | {"livez": lz.summary(), "session_turns": len(ttfts)}


def measure(config: Config, repos: dict[str, Path], admin_url: str) -> dict[str, dict[str, Any]]:
    """The measurements of ``config.parts`` against the server of each of ``repos``, all of them running at once
    (each with its own scratch database), one measurement after the other, alternating between the servers: a
    change in the machine's load between two measurements then falls on both alike."""
    env = {
        "KVCHAT_MAX_CONNECTIONS_PER_TENANT": str(config.cap),
        "KVCHAT_MAX_CONNECTIONS_PER_CLIENT": str(config.hellos + config.crashed),
        "KVCHAT_MAX_REQUEST_BYTES": str(config.max_request_mib * 1024 * 1024),
    }
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[Server, RssSampler]] = {}
        for name, repo in repos.items():
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvchat-refusals-")))
            url = stack.enter_context(scratch_database(admin_url))
            fconfig = fairness.Config(url, repo, seqs=config.seqs, waiting=config.waiting, reply_tokens=16)
            server = stack.enter_context(fairness.running_server(fconfig, workdir, env))
            servers[name] = server, stack.enter_context(RssSampler(server).running())
        reports: dict[str, dict[str, Any]] = {name: {} for name in repos}
        for part in config.parts:
            for name, (server, rss) in servers.items():
                reports[name] |= PART_RUNNERS[part](server, config, rss)
        for name, (server, rss) in servers.items():
            reports[name]["server_log_tracebacks"] = server.log_path.read_text(errors="replace").count("Traceback")
            reports[name]["rss_timeline"] = rss.samples
            reports[name]["rss_marks"] = rss.marks
    return reports


def livez(server: Server, config: Config, rss: RssSampler) -> dict[str, Any]:
    rss.mark("livez")
    return {
        "livez_sessions": asyncio.run(livez_beside_sessions(server, config, bodies=False)),
        "livez_bodies": asyncio.run(livez_beside_sessions(server, config, bodies=True)),
    }


def hellos(server: Server, config: Config, rss: RssSampler) -> dict[str, Any]:
    """The hello burst, then the crashed sockets, then ``settle_s`` of quiet: latencies and RSS."""
    solo = asyncio.run(hello_burst(server.ws, 1, TOKEN))
    start = rss.mark("hello burst")
    burst = asyncio.run(hello_burst(server.ws, config.hellos, TOKEN))
    rss.mark("crashed sockets")
    crashed = asyncio.run(crash_sockets(server.ws, config.crashed))
    closed = rss.mark("sockets closed")
    time.sleep(config.settle_s)
    settled = rss.mark(f"sockets +{config.settle_s:.0f} s")
    return {
        "hellos": {
            "control_welcome": solo.welcomed.summary(),
            "welcomed": burst.welcomed.summary(),
            "refused_1013": burst.refused.summary(),
            "reasons": burst.reasons,
            "other": burst.other,
            "crashed_welcomed": crashed,
            "rss_mib": {"start": start, "closed": closed, "settled": settled},
        }
    }


def streams(server: Server, config: Config, rss: RssSampler) -> dict[str, Any]:
    """The stream burst, then ``settle_s`` of quiet: latencies and RSS."""
    alone = asyncio.run(stream_burst(server.http, 1, TOKEN))
    start = rss.mark("stream burst")
    burst = asyncio.run(stream_burst(server.http, config.streams, TOKEN))
    closed = rss.mark("streams closed")
    time.sleep(config.settle_s)
    settled = rss.mark(f"streams +{config.settle_s:.0f} s")
    return {
        "streams": {
            "control_stream": alone.streamed.summary(),
            "streamed": burst.streamed.summary(),
            "refused_503": burst.refused.summary(),
            "other": burst.other,
            "rss_mib": {"start": start, "closed": closed, "settled": settled},
        }
    }


PART_RUNNERS = {"hellos": hellos, "streams": streams, "livez": livez}


def _commit(repo: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    return (out.stdout.strip() + ("-dirty" if dirty.strip() else "")) if out.stdout.strip() else repo.name


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


ROWS: tuple[tuple[str, str, str], ...] = (
    ("hello alone (control)", "hellos", "control_welcome"),
    ("hello burst: welcome", "hellos", "welcomed"),
    ("hello burst: 1013", "hellos", "refused_1013"),
    ("stream alone (control)", "streams", "control_stream"),
    ("stream burst: 200", "streams", "streamed"),
    ("stream burst: 503", "streams", "refused_503"),
    ("/livez beside sessions (control)", "livez_sessions", "livez"),
    ("/livez beside sessions + bodies", "livez_bodies", "livez"),
)


def table(runs: dict[str, dict[str, Any]]) -> str:
    head = f"{'measurement':<34} " + " ".join(f"{name[:18]:>18} {'p50 ms':>8} {'p99 ms':>8}" for name in runs)
    lines = [head]
    for label, part, key in ROWS:
        cells = []
        for report in runs.values():
            s = report.get(part, {}).get(key)
            cells.append("-" * 36 if s is None else f"{'n=' + str(s['n']):>18} {_ms(s['p50']):>8} {_ms(s['p99']):>8}")
        lines.append(f"{label:<34} " + " ".join(cells))
    for name, report in runs.items():
        notes = []
        for part in ("hellos", "streams"):
            if part in report:
                r = report[part]["rss_mib"]
                notes.append(
                    f"{part}: RSS MiB start {r['start']:.1f}, closed {r['closed']:.1f}, settled {r['settled']:.1f}"
                    f" ({r['settled'] - r['start']:+.1f}), other answers {report[part]['other']}"
                )
        if "livez_bodies" in report:
            notes.append(f"bodies {report['livez_bodies']['bodies']['statuses']}")
        notes.append(f"tracebacks in the server log {report['server_log_tracebacks']}")
        lines.append(f"{name}: " + "; ".join(notes))
    return "\n".join(lines)


PLOTTED: tuple[tuple[str, str, str], ...] = (
    ("1013 (hellos)", "hellos", "refused_1013"),
    ("503 (streams)", "streams", "refused_503"),
    ("/livez + sessions", "livez_sessions", "livez"),
    ("/livez + sessions + bodies", "livez_bodies", "livez"),
)


def plot(runs: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(runs)
    for i, (name, report) in enumerate(runs.items()):
        p99 = [(report.get(part, {}).get(key, {}).get("p99") or 0.0) * 1000 for _, part, key in PLOTTED]
        left.bar([x + i * width for x in range(len(PLOTTED))], p99, width, label=name)
    left.axhline(100, color="red", linewidth=0.6, linestyle="--", label="goal 100 ms (refusals)")
    left.axhline(50, color="orange", linewidth=0.6, linestyle=":", label="goal 50 ms (/livez)")
    left.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(PLOTTED))], [p[0] for p in PLOTTED])
    left.tick_params(axis="x", labelsize=7)
    left.set_ylabel("p99 (ms, client-side)")
    left.set_yscale("log")
    left.legend(fontsize=7)
    for name, report in runs.items():
        line = right.plot([t for t, _ in report["rss_timeline"]], [m for _, m in report["rss_timeline"]], label=name)
        for mark, at in report["rss_marks"]:
            right.axvline(at, color=line[0].get_color(), linewidth=0.4, linestyle=":")
            right.text(at, 0.01, mark, rotation=90, fontsize=6, transform=right.get_xaxis_transform())
        for part in ("hellos", "streams"):
            if part in report:
                right.axhline(report[part]["rss_mib"]["start"] + 20, color=line[0].get_color(), linewidth=0.4)
    right.set_xlabel("seconds since the server was ready (solid thin lines: each burst's start RSS + 20 MB)")
    right.set_ylabel("server RSS (MiB)")
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.refusals", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--admin-url", required=True, help="a Postgres database to create each run's scratch database from")
    p.add_argument("--baseline", type=Path, help="another checkout, measured first by the same client")
    p.add_argument("--hellos", type=int, default=300)
    p.add_argument("--cap", type=int, default=200, help="KVCHAT_MAX_CONNECTIONS_PER_TENANT")
    p.add_argument("--crashed", type=int, default=100)
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--seqs", type=int, default=32, help="KVCHAT_MAX_NUM_SEQS")
    p.add_argument("--waiting", type=int, default=256, help="KVCHAT_MAX_WAITING")
    p.add_argument("--settle", type=float, default=30.0, help="seconds after the sockets close before RSS is read")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--livez-samples", type=int, default=500)
    p.add_argument("--max-request-mib", type=int, default=40, help="KVCHAT_MAX_REQUEST_BYTES, in MiB")
    p.add_argument("--parts", default=",".join(PARTS), help="which measurements, of: " + ", ".join(PARTS))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON result (the PNG goes next to it)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = Config(
        args.hellos, args.cap, args.crashed, args.streams, args.seqs, args.waiting, args.settle, args.sessions,
        args.livez_samples, args.max_request_mib, tuple(args.parts.split(",")),
    )  # fmt: skip
    repos = {f"baseline {_commit(args.baseline)}": args.baseline.resolve()} if args.baseline else {}
    repos[f"current {_commit(REPO_ROOT)}"] = REPO_ROOT
    runs = measure(config, repos, args.admin_url)
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.refusals " + shlex.join(argv or sys.argv[1:])
    title = "kvchat refusals, memory and /livez: " + " vs ".join(runs)
    print(table(runs))
    print(f"\ncommand: {command}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"title": title, "command": command, "machine": machine_info(), "config": asdict(config), "runs": runs}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, title, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
