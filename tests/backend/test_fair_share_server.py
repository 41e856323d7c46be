"""Two tenants on a real server (Postgres, the tiny model, an engine of 2 running slots): tenant A floods it with
long streams, tenant B then asks one short question. First come, first served, B's request waited behind every one
of A's (B finished after all but the ones running); with the fair scheduler it takes the next free slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.domain import KeyKind
from backend.services.tenants import add_key, create_tenant
from engine.llm_engine import LLMEngine
from support.engines import make_engine
from support.server import CHAT_TOKEN, LiveServer, db_session, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

B_KEY = "tenant-b-chat-key"
FLOOD = 10
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def narrow_engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture
def live(pg_url: str, tmp_path: Path, narrow_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path), narrow_engine) as server:
        yield server


async def _complete(http: httpx.AsyncClient, key: str, text: str, max_tokens: int) -> float:
    """One /v1 completion; returns when it finished (monotonic)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    response = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return time.monotonic()


async def test_a_flood_of_one_tenant_does_not_hold_the_other_tenants_reply(
    live: LiveServer, narrow_engine: LLMEngine
) -> None:
    async with db_session(live) as db:
        tenant = await create_tenant(db, "tenant-b")
        await add_key(db, tenant.id, KeyKind.CHAT, B_KEY)
        await db.commit()
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        flood = [asyncio.create_task(_complete(http, CHAT_TOKEN, f"order {i}?", 48)) for i in range(FLOOD)]
        deadline = time.monotonic() + 60
        while narrow_engine.stats().waiting < FLOOD - 2:  # A's requests are all in: 2 running, the rest waiting
            assert time.monotonic() < deadline, narrow_engine.stats()
            await asyncio.sleep(0.01)
        b_done = await _complete(http, B_KEY, "hello?", 4)
        a_done = await asyncio.gather(*flood)
    before_b = sum(1 for t in a_done if t < b_done)
    # Fair: B waits for one of the 2 running streams to end (a third may end meanwhile). FCFS: 10 of 10.
    assert before_b <= 3, f"{before_b} of tenant A's {FLOOD} requests finished before tenant B's"
