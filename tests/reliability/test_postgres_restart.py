"""Postgres restarts mid-session: the server recovers by itself and loses nothing that was acknowledged.

A throwaway cluster of our own (never the shared server) is restarted (``pg_ctl restart``, fast and immediate modes
in turn) while a websocket session talks: right after a message is sent, or right after it is acknowledged. The
socket must stay open throughout; a turn that hits the dead database answers with an ``error`` frame, and the client
sends the same ``client_msg_id`` again until it has its reply. In the end every acknowledged message is stored once
with exactly one reply. ``make test`` restarts 10 times; ``make soak`` 50.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from reliability.soak import only_in_soak, rounds
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from backend.db import migrate
from backend.db.models import Message
from engine.llm_engine import LLMEngine
from support.server import CHAT_TOKEN, server_settings, start_server, stop_server

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ANSWER_TIMEOUT_S = 120.0


def _root_conftest(config: pytest.Config) -> Any:
    """``tests/conftest.py`` as pytest loaded it (``import conftest`` finds whichever conftest came last)."""
    module = config.pluginmanager.get_plugin(str(Path(__file__).resolve().parents[1] / "conftest.py"))
    assert module is not None, "tests/conftest.py is not loaded"
    return module


class Cluster:
    """A throwaway Postgres cluster (``tests/conftest.py``'s) that this test may restart."""

    def __init__(self, helpers: Any) -> None:
        self.helpers = helpers
        self.pg = helpers.ThrowawayCluster()
        self.url = ""

    def start(self) -> None:
        dsn = self.pg.start()
        createdb = self.helpers._pg_bin("createdb") or "createdb"
        cmd = [createdb, "-h", "127.0.0.1", "-p", str(self.pg.port), "-U", "postgres", "kvchat"]
        subprocess.run(self.helpers._as_postgres_user(cmd), check=True, capture_output=True)
        self.url = dsn.replace("postgresql://", "postgresql+asyncpg://").rsplit("/", 1)[0] + "/kvchat"
        migrate.upgrade(self.url)

    def restart(self, mode: str) -> None:
        pg_ctl = self.helpers._pg_bin("pg_ctl")
        assert pg_ctl is not None
        data, log = self.pg.dir / "data", self.pg.dir / "log"
        cmd = [pg_ctl, "-D", str(data), "-l", str(log), "-m", mode, "-w", "-t", "60", "restart"]
        subprocess.run(self.helpers._as_postgres_user(cmd), check=True, capture_output=True)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    own = Cluster(_root_conftest(request.config))
    try:
        own.start()
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        own.pg.stop()
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"a throwaway Postgres cluster is required under CI: {exc}", pytrace=False)
        pytest.skip(f"no throwaway Postgres cluster (initdb/pg_ctl): {exc}")
    try:
        yield own
    finally:
        own.pg.stop()


async def _answer(ws: Any, cid: str, text: str, acked: dict[str, int], errors: Counter[str]) -> dict[str, Any]:
    """Send ``cid`` until it has its reply; every error frame on the way is counted, and the socket must stay."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": cid, "text": text}))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_TIMEOUT_S))
            if frame["type"] == "message.ack":
                # a retry's ack must name the seq the first one did (acks of earlier retries may still arrive)
                assert acked.setdefault(frame["client_msg_id"], frame["seq"]) == frame["seq"], frame
            elif frame["type"] == "message.completed" and frame["client_msg_id"] == cid:
                return dict(frame)
            elif frame["type"] == "error" and frame.get("client_msg_id") == cid:
                errors[frame["code"]] += 1
                await asyncio.sleep(max(0.2, (frame.get("retry_after_ms") or 0) / 1000))
                break
    raise AssertionError(f"{cid} got no reply within {ANSWER_TIMEOUT_S:.0f}s")


async def _restarts(n: int, cluster: Cluster, tmp_path: Path, engine: LLMEngine) -> tuple[dict[str, int], Counter[str]]:
    live = await asyncio.to_thread(start_server, server_settings(cluster.url, tmp_path), engine)
    acked: dict[str, int] = {}
    errors: Counter[str] = Counter()
    try:
        async with websockets.connect(live.ws, max_queue=None) as ws:
            await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
            assert json.loads(await ws.recv())["type"] == "welcome"
            for i in range(n):
                mode = ("fast", "immediate")[i % 2]
                cid, text = f"m{i}", f"Question {i}: where is my parcel?"
                if i % 4 >= 2:  # restart right after the ack (the turn hits it), else right after sending
                    await ws.send(json.dumps({"type": "user.message", "client_msg_id": cid, "text": text}))
                    while (frame := json.loads(await ws.recv()))["type"] not in ("message.ack", "error"):
                        pass
                    if frame["type"] == "message.ack":
                        acked[cid] = frame["seq"]
                restart = asyncio.create_task(asyncio.to_thread(cluster.restart, mode))
                await _answer(ws, cid, text, acked, errors)
                await restart
                await _answer(ws, f"{cid}-after", f"And after restart {i}?", acked, errors)
    finally:
        await asyncio.to_thread(stop_server, live)
    return acked, errors


async def _check(url: str, acked: dict[str, int]) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(Message.__table__))).all()
    finally:
        await engine.dispose()
    users = {r.client_msg_id: r for r in rows if r.role == "user"}
    assert {cid: users[cid].seq for cid in acked if cid in users} == acked  # nothing acknowledged is lost
    replies = Counter(r.reply_to_seq for r in rows if r.role == "assistant")
    assert sorted(replies[u.seq] for u in users.values()) == [1] * len(users)  # one reply each, no duplicates
    assert sorted(r.seq for r in rows) == list(range(1, len(rows) + 1))


async def test_a_session_survives_postgres_restarts(cluster: Cluster, tmp_path: Path, tiny_engine: LLMEngine) -> None:
    acked, errors = await _restarts(rounds(10), cluster, tmp_path, tiny_engine)
    await _check(cluster.url, acked)
    assert len(acked) == 2 * rounds(10)
    print(f"postgres restarts: {rounds(10)} restarts, {len(acked)} messages acked, 0 lost; error frames {dict(errors)}")


@pytest.mark.soak
@pytest.mark.timeout(7200)  # NOTE: 100 rounds outlast the suite's 10-minute cap for one test
@only_in_soak
async def test_a_session_survives_postgres_restarts_soak(
    cluster: Cluster, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    acked, errors = await _restarts(rounds(50), cluster, tmp_path, tiny_engine)
    await _check(cluster.url, acked)
    assert len(acked) == 2 * rounds(50)
    print(f"postgres restarts: {rounds(50)} restarts, {len(acked)} messages acked, 0 lost; error frames {dict(errors)}")
