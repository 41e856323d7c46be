"""Erasure on every tier, through a real server on Postgres whose engine has a disk tier: a closed session's blocks
are demoted to disk (not dropped); deleting the session removes them from disk and memory, and says how many."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from engine.kv.tier_config import CacheSettings
from engine.llm_engine import LLMEngine
from support.engines import make_engine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

A = {"X-API-Key": ADMIN_KEY}
TIMEOUT = 60


@pytest.fixture
def disk_engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LLMEngine]:
    engine = make_engine(
        tiny_model_dir,
        disk_cache_dir=str(tmp_path / "kv_cache"),
        max_num_seqs=4,
        cache_settings=CacheSettings(min_free_space_gb=0),  # (no free-space floor: a nearly full disk still writes)
    )
    asyncio.run(engine.start())
    try:
        yield engine
    finally:
        asyncio.run(engine.stop())


@pytest.fixture
def live(pg_url: str, tmp_path: Path, disk_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path / "data"), disk_engine) as server:
        yield server


async def _turn(live: LiveServer, text: str) -> str:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = str(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["session_id"])
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": text}))
        while json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"] != "message.completed":
            pass
    return session_id


async def test_deleting_a_closed_session_erases_its_blocks_from_memory_and_disk(
    live: LiveServer, disk_engine: LLMEngine
) -> None:
    session_id = await _turn(live, "My parcel is late. Order #4061234567 was due on Monday, where is it?")
    async with httpx.AsyncClient(base_url=live.http) as http:
        closed = await http.post(f"/admin/sessions/{session_id}/status", headers=A, json={"status": "closed"})
        assert closed.status_code == 200
        deleted = await http.delete(f"/admin/sessions/{session_id}", headers=A)
    assert deleted.status_code == 200, deleted.text
    erased = deleted.json()
    tiers = disk_engine.stats().tiers
    assert tiers.demoted_blocks >= 1  # closing demoted the session to disk instead of dropping it
    assert erased["disk_blocks"] >= 1  # and the erasure found it there
    assert tiers.disk_blocks == 0  # nothing of it is left on disk
