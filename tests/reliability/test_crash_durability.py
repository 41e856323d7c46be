"""Crash durability: kill -9 a real ``kvchat serve`` (Postgres, tiny model) at random points of a turn, restart it,
resume every session with ``last_seq``, and check what was promised.

* every acknowledged message is stored exactly once, at the seq its ack named;
* every user message the bot was to answer has exactly one reply, ``complete`` or ``incomplete`` — right after each
  restart too (the start marks the turns the crash cut off, before any socket is served);
* a resume replays every message after ``last_seq``: no gaps, no duplicates; seqs in the database are 1..n.

Kill points rotate: right after an ack, mid-stream (after the k-th delta), inside the reply's commit (the
``KVCHAT_TEST_COMMIT_DELAY_SECONDS`` hook holds each reply's transaction open), and after a random delay. (Kills in
the middle of a disk-tier write are ``tests/engine/kv/test_disk_kill.py``.) ``make test`` runs 10 crashes; ``make
soak`` 100. One more test runs the rounds beside a second kvchat server on the same Postgres.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from reliability.customer import Customer
from reliability.soak import only_in_soak, rounds
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import create_async_engine

from backend.db.engine import worker_prefix
from backend.db.models import Message
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

CUSTOMERS = 3
KILL_POINTS = ("after_ack", "mid_stream", "in_commit", "random")
SESSIONS_DEADLINE_S = 120.0  # generous: Postgres notices a dead client at once, but a loaded CI box may be slow


@dataclass(slots=True)
class Tally:
    crashes: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    incomplete: int = 0
    gaps: int = 0

    def line(self) -> str:
        return (
            f"crash durability: {self.crashes} crashes (kill -9), {self.acked} messages acked, {self.lost} lost, "
            f"{self.duplicated} duplicated, {self.incomplete} replies marked incomplete, {self.gaps} replay gaps"
        )


class Trigger:
    """Fires (kills the server) at this round's kill point; counts the frames it watches."""

    def __init__(self, point: str, rng: random.Random, kill: Callable[[], None]) -> None:
        self.point = point
        self.kill = kill
        self.fired = False
        self.after = rng.randint(1, 3) if point == "after_ack" else rng.randint(1, 12)
        self.count = 0

    def __call__(self, frame: dict[str, Any]) -> None:
        watched = {"after_ack": "message.ack", "mid_stream": "message.delta"}.get(self.point)
        if self.fired or frame["type"] != watched:
            return
        self.count += 1
        if self.count >= self.after:
            self.fire()

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.kill()


async def _db_rows(pg_url: str) -> list[Any]:
    # NOTE: a plain engine, not a named kvchat worker: the server's start must not take the test for a peer.
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(select(Message.__table__))).all())
    finally:
        await engine.dispose()


async def _worker_sessions(pg_url: str, pid: int) -> int:
    """The database sessions the kvchat server ``pid`` holds on this test's database.

    NOTE: scoped to this database and to that process's own connection names (they carry its pid:
    ``backend.db.engine.worker_prefix``): another kvchat server on the same Postgres is another test's business.
    """
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            count = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE :prefix"
                ),
                {"prefix": worker_prefix(pid) + "%"},
            )
        return int(count or 0)
    finally:
        await engine.dispose()


async def _until_sessions(pg_url: str, pid: int, gone: bool) -> None:
    """Poll until the server ``pid`` holds no session on the database (``gone``), or holds one.

    After kill -9, Postgres ends the dead process's sessions once it sees their sockets close; the next start must not
    take them for a live peer (it would leave the cut-off turns unmarked).
    """
    deadline = time.monotonic() + SESSIONS_DEADLINE_S
    while (await _worker_sessions(pg_url, pid) == 0) != gone:
        if time.monotonic() > deadline:
            state = "still holds" if gone else "never opened"
            raise AssertionError(f"kvchat server {pid} {state} database sessions after {SESSIONS_DEADLINE_S:.0f}s")
        await asyncio.sleep(0.1)


def _check_database(rows: list[Any], customers: list[Customer], tally: Tally, settled: bool) -> None:
    """The promises, read from the database. ``settled``: no turn is running, so every message has its reply."""
    by_session: dict[str, list[Any]] = {}
    for r in rows:
        by_session.setdefault(r.session_id, []).append(r)
    for session_rows in by_session.values():
        assert sorted(r.seq for r in session_rows) == list(range(1, len(session_rows) + 1))
    users = {(r.session_id, r.client_msg_id): r for r in rows if r.role == "user"}
    replies = Counter((r.session_id, r.reply_to_seq) for r in rows if r.role == "assistant")
    tally.duplicated = sum(n - 1 for n in replies.values() if n > 1)
    tally.lost = sum(
        1
        for c in customers
        for cid, seq in c.acked.items()
        if (c.session_id, cid) not in users or users[(c.session_id, cid)].seq != seq
    )
    tally.acked = sum(len(c.acked) for c in customers)
    tally.incomplete = sum(1 for r in rows if r.role == "assistant" and r.status == "incomplete")
    assert tally.lost == 0, tally.line()
    assert tally.duplicated == 0, tally.line()
    if settled:
        unanswered = [(s, u.seq, u.status) for (s, _), u in users.items() if replies[(s, u.seq)] != 1]
        assert unanswered == [], unanswered
        assert {r.status for r in rows if r.role == "assistant"} <= {"complete", "incomplete"}


async def _crash_rounds(n: int, pg_url: str, model_dir: Path, tmp_path: Path, seed: int) -> Tally:
    rng = random.Random(seed)
    customers = [Customer(f"c{i}", random.Random(seed * 100 + i)) for i in range(CUSTOMERS)]
    tally = Tally()
    for round_no in range(n + 1):
        last = round_no == n
        point = KILL_POINTS[round_no % len(KILL_POINTS)]
        settings: dict[str, object] = {"reply_max_tokens": 8, "run_migrations_on_start": "false"}
        if point == "in_commit":
            settings["test_commit_delay_seconds"] = 0.5
        env = tiny_server_env(pg_url, model_dir, tmp_path, **settings)
        server = await asyncio.to_thread(start_server_process, env, tmp_path / f"serve-{round_no}.log")
        try:
            # the start has marked what the last crash cut off: every stored message has its one reply
            _check_database(await _db_rows(pg_url), customers, tally, settled=True)
            if last:
                await asyncio.gather(*(c.chat(server.ws, lambda f: None, turns=2) for c in customers))
            else:
                await _drive_until_killed(server, customers, point, rng)
                tally.crashes += 1
        finally:
            if last:
                server.terminate()
            server.kill()
        await _until_sessions(pg_url, server.proc.pid, gone=True)
    _check_database(await _db_rows(pg_url), customers, tally, settled=True)
    tally.gaps = sum(len(c.replay.gaps) for c in customers)
    assert [(c.name, c.replay.gaps, c.replay.duplicates) for c in customers] == [(c.name, [], []) for c in customers]
    return tally


async def _drive_until_killed(server: ServerProcess, customers: list[Customer], point: str, rng: random.Random) -> None:
    trigger = Trigger(point, rng, server.kill)
    chats = [asyncio.create_task(c.chat(server.ws, trigger)) for c in customers]
    if point in ("in_commit", "random"):
        # NOTE: in_commit: each reply spends 0.5 s of its ~1 s inside its open transaction, so a random moment
        # lands there most of the time; random: anywhere in a turn
        await asyncio.sleep(rng.uniform(0.3, 2.5))
        await asyncio.to_thread(trigger.fire)
    done, _ = await asyncio.wait(chats, timeout=120)
    assert len(done) == len(chats), "a customer is still talking to a server that should be dead"
    if not trigger.fired:  # the kill point never came (too few frames): kill anyway, the round still counts
        trigger.fire()


async def test_every_acknowledged_message_survives_kill_9(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    tally = await _crash_rounds(rounds(10), pg_url, tiny_model_dir, tmp_path, seed=20)
    print(tally.line())
    assert tally.crashes == rounds(10)
    assert tally.acked > rounds(10)


async def test_kill_9_rounds_pass_beside_another_kvchat_server_on_the_same_postgres(
    pg_url: str, pg_other_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 27: with a second kvchat server connected to the same Postgres (its own database), every round still
    waits only for its own server's sessions, and every promise holds."""
    neighbour_dir = tmp_path / "neighbour"
    neighbour_dir.mkdir()
    env = tiny_server_env(pg_other_url, tiny_model_dir, neighbour_dir, run_migrations_on_start="false")
    neighbour = await asyncio.to_thread(start_server_process, env, tmp_path / "neighbour.log")
    try:
        await _until_sessions(pg_other_url, neighbour.proc.pid, gone=False)  # it is connected
        tally = await _crash_rounds(len(KILL_POINTS), pg_url, tiny_model_dir, tmp_path, seed=22)
        assert await _worker_sessions(pg_other_url, neighbour.proc.pid) > 0  # and it stayed connected throughout
    finally:
        neighbour.terminate()
    print(tally.line())
    assert tally.crashes == len(KILL_POINTS)


@pytest.mark.soak
@pytest.mark.timeout(7200)  # NOTE: 100 rounds outlast the suite's 10-minute cap for one test
@only_in_soak
async def test_every_acknowledged_message_survives_kill_9_soak(
    pg_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tally = await _crash_rounds(rounds(100), pg_url, tiny_model_dir, tmp_path, seed=21)
    print(tally.line())
    assert tally.crashes == rounds(100)
