"""Revocation reaches live sockets (issue 28, defect 2), through a real server on SQLite and on Postgres.

Before the fix a websocket opened with a chat token kept its acks and replies after the token was rotated, until it
closed or its session timed out (an hour). Now rotating or revoking the key closes every socket it opened with 4401
"key revoked" within a second: through the admin API (this process's fast path), and from another process (here the
test's own database session, as ``kvchat keys revoke`` or another worker would: Postgres NOTIFY, or SQLite's poll).
Sockets of other keys stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from sqlalchemy import select
from websockets.asyncio.client import ClientConnection

from backend.db.models import ApiKey
from backend.domain import KeyKind
from backend.services import tenants
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session, server_settings, serving
from support.ws_chat import Chat

pytestmark = pytest.mark.anyio

UNAUTHORIZED = 4401
REVOCATION_BOUND_S = 1.0  # the bound
TIMEOUT_S = 30.0
ADMIN = {"X-API-Key": ADMIN_KEY}


@pytest.fixture
def live(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


async def _closed_after(ws: ClientConnection, started: float) -> tuple[int | None, str | None, float]:
    """Read until the server closes the socket: its close code and reason, and the seconds since ``started``."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), TIMEOUT_S)  # (a timeout fails the test: the socket stayed open)
    return ws.close_code, ws.close_reason, time.perf_counter() - started


async def _pong(ws: ClientConnection) -> str:
    await ws.send(json.dumps({"type": "ping", "nonce": "n"}))
    return str(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))["type"])


async def test_rotating_the_chat_token_closes_its_sockets_and_not_others(live: LiveServer) -> None:
    async with (
        websockets.connect(live.ws) as first,
        websockets.connect(live.ws) as second,
        httpx.AsyncClient(base_url=live.http) as http,
    ):
        for ws in (first, second):
            await Chat(ws).hello(CHAT_TOKEN)
        admin = await http.post("/admin/tenant/keys/rotate", headers=ADMIN, json={"kind": "admin"})
        assert admin.status_code == 200
        assert [await _pong(first), await _pong(second)] == ["pong", "pong"]  # another key's rotation: still open
        new_admin = {"X-API-Key": admin.json()["key"]}
        started = time.perf_counter()
        rotated = await http.post("/admin/tenant/keys/rotate", headers=new_admin, json={"kind": "chat"})
        closes = [await _closed_after(ws, started) for ws in (first, second)]
        assert rotated.status_code == 200
        async with websockets.connect(live.ws) as fresh:  # the new token opens a socket, which stays open
            await Chat(fresh).hello(rotated.json()["key"])
            assert await _pong(fresh) == "pong"
    assert [(code, reason) for code, reason, _ in closes] == [(UNAUTHORIZED, "key revoked")] * 2
    assert max(elapsed for _, _, elapsed in closes) < REVOCATION_BOUND_S, closes


async def test_a_revocation_by_another_process_closes_the_socket(live: LiveServer) -> None:
    """The revocation is committed by another database session (``kvchat keys revoke``, another worker): Postgres
    notifies this server's listener; on SQLite its poll finds it."""
    async with websockets.connect(live.ws) as ws:
        await Chat(ws).hello(CHAT_TOKEN)
        async with db_session(live) as db:
            key_id = (await db.execute(select(ApiKey.id).where(ApiKey.kind == KeyKind.CHAT.value))).scalar_one()
            started = time.perf_counter()
            await tenants.revoke_key(db, key_id)
            await db.commit()
        code, reason, elapsed = await _closed_after(ws, started)
    assert (code, reason) == (UNAUTHORIZED, "key revoked")
    assert elapsed < REVOCATION_BOUND_S, elapsed


async def test_a_revoked_token_cannot_open_a_socket_again(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        keys = (await http.get("/admin/tenant/keys", headers=ADMIN)).json()
        chat_key = next(k["id"] for k in keys if k["kind"] == "chat")
        revoked = await http.post(f"/admin/tenant/keys/{chat_key}/revoke", headers=ADMIN)
    assert revoked.status_code == 200
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        code, reason, _ = await _closed_after(ws, time.perf_counter())
    assert (code, reason) == (UNAUTHORIZED, "invalid token")
