"""SQLite's store step under concurrent turns, with the write queue (``backend/db/sqlite_writer.py``) and without.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.sqlite_writes

``--writers`` tasks on one event loop and one SQLAlchemy engine (``create_db_engine``, as the server's), each storing
messages as a chat turn does: in one transaction the session row locked (``UPDATE ... RETURNING``), the
``client_msg_id`` looked up, the next seq read, the message inserted, the commit; between two turns a think time
(uniform 0..2x ``--think-ms``). Timed: the transaction, from its first statement to its commit. Without the queue
(``queue_for`` patched to none: how the driver ran before) the writers meet at SQLite's file lock and its busy
handler; with it, they wait their turn on an asyncio lock. The two alternate, ``--rounds`` times each, on fresh files.
Prints a table and writes ``docs/benchmarks/sqlite_writes.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.db import sqlite_driver
from backend.db.engine import create_db_engine
from bench.reporting import machine_info

DEFAULT_OUT = Path("docs/benchmarks/sqlite_writes.json")
SCHEMA = (
    "CREATE TABLE sessions (id INTEGER PRIMARY KEY, next_seq INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE messages (id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL, seq INTEGER NOT NULL, "
    "client_msg_id TEXT NOT NULL, content TEXT NOT NULL, UNIQUE (session_id, client_msg_id))",
)


async def _store(engine: AsyncEngine, session: int, turn: int) -> float:
    began = time.perf_counter()
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE sessions SET next_seq = next_seq WHERE id = :s RETURNING next_seq"), {"s": session}
        )
        await conn.execute(
            text("SELECT id FROM messages WHERE session_id = :s AND client_msg_id = :c"), {"s": session, "c": f"{turn}"}
        )
        seq = (await conn.execute(text("SELECT max(seq) FROM messages WHERE session_id = :s"), {"s": session})).scalar()
        await conn.execute(
            text("INSERT INTO messages (session_id, seq, client_msg_id, content) VALUES (:s, :q, :c, :t)"),
            {"s": session, "q": (seq or 0) + 1, "c": f"{turn}", "t": "Where is my parcel? " * 8},
        )
    return (time.perf_counter() - began) * 1000


async def _round(queued: bool, writers: int, turns: int, think_ms: float, seed: int) -> tuple[list[float], float]:
    """The round's transaction times (ms) and its wall time (s)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_db_engine(f"sqlite+aiosqlite:///{Path(tmp) / 'writes.db'}")
        original = sqlite_driver.queue_for
        if not queued:
            sqlite_driver.queue_for = lambda _database: None  # type: ignore[assignment]
        try:
            async with engine.begin() as conn:
                for statement in SCHEMA:
                    await conn.execute(text(statement))
                await conn.execute(
                    text("INSERT INTO sessions (id) VALUES " + ",".join(f"({i})" for i in range(writers)))
                )
            times: list[float] = []

            async def writer(session: int) -> None:
                for turn in range(turns):
                    await asyncio.sleep(rng.uniform(0, 2 * think_ms) / 1000)
                    times.append(await _store(engine, session, turn))

            began = time.perf_counter()
            await asyncio.gather(*(writer(i) for i in range(writers)))
            return times, time.perf_counter() - began
        finally:
            sqlite_driver.queue_for = original
            await engine.dispose()


def _summary(times: list[float], wall_s: float) -> dict[str, float]:
    q = statistics.quantiles(times, n=100, method="inclusive")
    summary = {"n": len(times), "per_s": len(times) / wall_s, "p50_ms": q[49], "p90_ms": q[89], "p99_ms": q[98]}
    return summary | {"max_ms": max(times)}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[float]] = {"file lock": [], "queued": []}
    walls = {"file lock": 0.0, "queued": 0.0}
    for r in range(args.rounds):
        for queued in (False, True) if r % 2 == 0 else (True, False):
            times, wall_s = await _round(queued, args.writers, args.turns, args.think_ms, args.seed + r)
            results["queued" if queued else "file lock"] += times
            walls["queued" if queued else "file lock"] += wall_s
    return {name: _summary(times, walls[name]) for name, times in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=50, help="concurrent sessions storing messages")
    p.add_argument("--turns", type=int, default=40, help="messages each stores")
    p.add_argument("--think-ms", type=float, default=20.0, help="mean pause between two of a session's messages")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each variant, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    summary = asyncio.run(_main(args))
    print("| writes | transactions | per s | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['n']:.0f} | {s['per_s']:.0f} | {s['p50_ms']:.2f} ms | {s['p90_ms']:.2f} ms "
            f"| {s['p99_ms']:.2f} ms | {s['max_ms']:.1f} ms |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["python -m bench.sqlite_writes", *(argv or sys.argv[1:])]), "args": vars(args)}
    record |= {"machine": machine_info(), "results": summary}
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
