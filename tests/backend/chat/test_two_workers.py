"""Two ``kvchat serve`` workers on one Postgres database act as one chat service (issue 31): a customer who
reconnects to the other worker mid-reply gets the rest of it with no gap and no duplicate; killing the worker that
acknowledged a message leaves that message marked ``incomplete`` (and the customer, now on the other worker, is
told); the connection caps count both workers' sockets.

Real processes (``backend/chat/fanout.py`` rides on Postgres LISTEN/NOTIFY), the tiny model (it never stops on its
own: a reply runs to ``reply_max_tokens``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from backend.db.models import Message
from support.server import CHAT_TOKEN
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT_S = 60.0
LONG_REPLY = 1500  # tokens: long enough to still be streaming when the customer moves to the other worker


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return frame


async def _hello(ws: Any, session_id: str | None = None, last_seq: int = 0) -> dict[str, Any]:
    hello: dict[str, Any] = {"type": "hello", "token": CHAT_TOKEN, "last_seq": last_seq}
    if session_id is not None:
        hello["session_id"] = session_id
    await ws.send(json.dumps(hello))
    welcome = await _recv(ws)
    assert welcome["type"] == "welcome", welcome
    return welcome


async def _until(ws: Any, kind: str) -> list[dict[str, Any]]:
    """Frames up to and including the first of ``kind``."""
    frames = []
    while True:
        frames.append(await _recv(ws))
        if frames[-1]["type"] == kind:
            return frames


@pytest.fixture(scope="module")
def workers(
    pg_module_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    """Workers A and B, shared by the module's tests (the last one kills A)."""
    tmp_path = tmp_path_factory.mktemp("workers")
    started: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            data = tmp_path / name
            data.mkdir()
            env = tiny_server_env(
                pg_module_url,
                tiny_model_dir,
                data,
                reply_max_tokens=LONG_REPLY,
                run_migrations_on_start="false",
                max_connections_per_tenant=3,
            )
            started.append(start_server_process(env, tmp_path / f"serve-{name}.log"))
        yield started
    finally:
        for server in started:
            server.kill()


async def test_a_reconnect_to_the_other_worker_mid_reply_resumes_without_gap_or_duplicate(
    workers: list[ServerProcess],
) -> None:
    a, b = workers
    async with websockets.connect(a.ws, max_queue=None) as on_a:
        session_id = (await _hello(on_a))["session_id"]
        await on_a.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": "Where is my parcel?"}))
        ack = (await _until(on_a, "message.ack"))[-1]
        seen_on_a = await _until(on_a, "message.delta")  # the reply streams on worker A
        async with websockets.connect(b.ws, max_queue=None) as on_b:
            welcome = await _hello(on_b, session_id, last_seq=ack["seq"])
            from_b = await _until(on_b, "message.completed")
        seen_on_a += await _until(on_a, "message.completed")
    completed = from_b[-1]
    assert completed == seen_on_a[-1]  # the same reply, as worker A's own socket saw it end
    assert welcome["in_flight"] is not None, "the reply had ended before the customer moved: nothing was resumed"
    assert welcome["in_flight"]["client_msg_id"] == "m1"
    deltas = [f["text"] for f in from_b if f["type"] == "message.delta"]
    assert welcome["in_flight"]["text"] + "".join(deltas) == completed["text"]  # no gap, no duplicate
    assert deltas, "nothing streamed through worker B"
    assert completed["status"] == "complete"


async def _frames_heard(server: ServerProcess) -> float:
    """The worker's ``kvchat:fanout_frames_heard_total`` (``/metrics``, answered on loopback)."""
    async with httpx.AsyncClient(base_url=server.http, timeout=TIMEOUT_S) as http:
        text = (await http.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["kvchat:fanout_frames_heard"].samples if s.name.endswith("_total"))


async def test_a_worker_without_a_socket_of_a_session_hears_none_of_its_deltas(workers: list[ServerProcess]) -> None:
    a, b = workers
    await asyncio.sleep(2.0)  # (the earlier tests' sockets are closed and announced: the tenant's cap is 3)
    async with (
        websockets.connect(a.ws, max_queue=None) as only_on_a,
        websockets.connect(a.ws, max_queue=None) as shared_on_a,
        websockets.connect(b.ws, max_queue=None) as shared_on_b,
    ):
        await _hello(only_on_a)  # session S: no socket on B
        shared = (await _hello(shared_on_a))["session_id"]  # session T: a socket on each worker
        await _hello(shared_on_b, shared)
        before = await _frames_heard(b)
        for ws, msg in ((only_on_a, "s1"), (shared_on_a, "t1")):  # both replies stream on A
            await ws.send(json.dumps({"type": "user.message", "client_msg_id": msg, "text": "Where is my parcel?"}))
        await _until(only_on_a, "message.completed")
        await _until(shared_on_a, "message.completed")
        seen_on_b = await _until(shared_on_b, "message.completed")
        await asyncio.sleep(0.5)  # (anything of S that reached B would have by now: A sent it in one stream with T's)
        heard = await _frames_heard(b) - before
    deltas_on_b = sum(f["type"] == "message.delta" for f in seen_on_b)
    assert deltas_on_b > 0  # T's reply reached B's socket through the fan-out
    assert heard == len(seen_on_b)  # every frame B heard was T's: none of S's


async def test_the_tenant_cap_counts_the_sockets_of_both_workers(workers: list[ServerProcess]) -> None:
    a, b = workers
    await asyncio.sleep(2.0)  # (the earlier tests' sockets are closed and announced)
    async with (
        websockets.connect(a.ws) as one,
        websockets.connect(a.ws) as two,
        websockets.connect(b.ws) as three,
    ):
        for ws in (one, two, three):
            await _hello(ws)
        await asyncio.sleep(2.0)  # (heartbeats: a change is announced within ~0.1 s, and every second anyway)
        for server in (a, b):
            async with websockets.connect(server.ws) as fourth:
                await fourth.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await _recv(fourth)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1013, closed.value.rcvd
            assert "tenant" in closed.value.rcvd.reason
    await asyncio.sleep(2.0)
    async with websockets.connect(b.ws) as later:  # the sockets closed: room again
        await _hello(later)


async def test_killing_the_worker_that_acknowledged_a_message_marks_it_incomplete(
    workers: list[ServerProcess], pg_module_url: str
) -> None:
    a, b = workers
    async with websockets.connect(b.ws, max_queue=None) as on_b:
        async with websockets.connect(a.ws, max_queue=None) as on_a:
            session_id = (await _hello(on_a))["session_id"]
            await _hello(on_b, session_id)
            await on_a.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": "Refund, please."}))
            ack = (await _until(on_a, "message.ack"))[-1]
            await _until(on_b, "message.delta")  # streaming on A, seen through B
            await asyncio.to_thread(a.kill)
        frames = await _until(on_b, "message.completed")  # the survivor marks the cut-off turn
    completed = frames[-1]
    assert completed["client_msg_id"] == "m1"
    assert completed["status"] == "incomplete"
    engine = create_async_engine(pg_module_url)
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(Message.seq, Message.role, Message.status, Message.reply_to_seq)
                    .where(Message.session_id == session_id)
                    .order_by(Message.seq)
                )
            ).all()
    finally:
        await engine.dispose()
    assert [(r.seq, r.role) for r in rows] == [(ack["seq"], "user"), (completed["seq"], "assistant")]
    assert rows[0].status != "awaiting_reply"  # settled: no reply is owed any more
    assert (rows[1].status, rows[1].reply_to_seq) == ("incomplete", ack["seq"])
    async with websockets.connect(b.ws, max_queue=None) as again:  # and a resume says which reply was cut off
        welcome = await _hello(again, session_id)
    assert welcome["cut_off"] == [ack["seq"]]
