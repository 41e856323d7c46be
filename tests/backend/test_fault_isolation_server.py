"""Issue 20, defect 1, through a real server: one tenant's poisoned request fails (or is served) alone.

While tenant B's websocket reply and a ``/v1/chat/completions`` call are decoding, tenant A sends a request that used
to fail the whole engine step: a ``top_p`` below float32's range (the sampler turned it into NaN), or a prompt the
model fails on (injected with ``engine.testing.Faults``). B's reply must be stored ``complete``, the concurrent API
call must return 200, and A must get a clean answer: a 200 for the edge value (it is valid: only the top token is
kept), a 500 ``engine_error`` for the failing prompt. The engine's record of forward passes proves the three
requests really shared a step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import select

from backend.db.models import Message
from backend.domain import KeyKind
from backend.services.tenants import DEFAULT_SYSTEM_PROMPT, add_key, create_tenant
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from engine.sampling_params import SamplingParams
from engine.testing import Faults
from support.engines import make_engine
from support.server import CHAT_TOKEN, LiveServer, db_session, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT = 60.0
TENANT_B_TOKEN = "tenant-b-chat-token"
LONG = 400  # tokens B's reply and the concurrent call decode: they are still running when A arrives
B_TEXT = "Hello, I ordered a blue jacket last week and it has not arrived yet."
C_MESSAGES = [{"role": "user", "content": "Please reset my password; I cannot log in to my account."}]
A_MESSAGES = [{"role": "user", "content": "Crème brûlée QZQZ café"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    """An engine of this module's own, so the faults it installs reach no other test."""
    engine = make_engine(tiny_model_dir, max_num_seqs=8)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture
def live(pg_url: str, tmp_path: Path, engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path, reply_max_tokens=LONG), engine) as server:
        yield server


@pytest.fixture
async def http(live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as client:
        yield client


async def add_tenant_b(live: LiveServer) -> None:
    async with db_session(live) as db:
        tenant = await create_tenant(db, "tenant-b")
        await add_key(db, tenant.id, KeyKind.CHAT, TENANT_B_TOKEN)
        await db.commit()


async def completion(http: httpx.AsyncClient, token: str, **body: Any) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions", headers={"Authorization": f"Bearer {token}"}, json={"model": "default", **body}
    )


async def wait_until(condition: Any, what: str) -> None:
    """Poll ``condition()`` (no fixed sleeps: the box may be slow); fail after TIMEOUT."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def tenant_b_reply_while(live: LiveServer, http: httpx.AsyncClient, engine: LLMEngine, attack: Any) -> Any:
    """Start B's websocket reply and a concurrent API call, run ``attack()`` while both decode, and return
    (B's completed frame, B's session id, the API response, the attack's result)."""
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        await ws.send(json.dumps({"type": "hello", "token": TENANT_B_TOKEN}))
        welcome = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        assert welcome["type"] == "welcome", welcome
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "b1", "text": B_TEXT}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        while frame["type"] != "message.delta":
            assert frame["type"] == "message.ack", frame
            frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        concurrent = asyncio.create_task(
            completion(http, CHAT_TOKEN, messages=C_MESSAGES, max_tokens=LONG, temperature=0)
        )
        await wait_until(lambda: engine.stats().running == 2, "B's reply and the API call to be decoding together")
        attacked = await attack()
        while frame["type"] != "message.completed":
            frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        response = await asyncio.wait_for(concurrent, TIMEOUT)
    return frame, welcome["session_id"], response, attacked


async def assert_b_stored_complete(live: LiveServer, session_id: str, completed: dict[str, Any]) -> None:
    assert (completed["status"], completed["finish_reason"]) == ("complete", "length")
    assert completed["usage"]["completion_tokens"] == LONG
    async with db_session(live) as db:
        rows = (await db.execute(select(Message).where(Message.session_id == session_id))).scalars().all()
    assert sorted((m.role, m.status) for m in rows) == [("assistant", "complete"), ("user", "complete")]


def assert_concurrent_call_ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("length", LONG)


def assert_shared_a_step(faults: Faults) -> None:
    """A's request was computed in a step with B's reply and the API call (else this test proved nothing)."""
    assert max(len(set(batch)) for batch in faults.forward_batches) == 3


async def greedy(engine: LLMEngine, messages: list[dict[str, str]], max_tokens: int) -> str:
    events = [e async for e in engine.generate(messages, SamplingParams(max_tokens=max_tokens), namespace="ref")]
    final = events[-1]
    assert isinstance(final, RequestFinished)
    return final.text


@pytest.mark.postgres
@pytest.mark.parametrize("top_p", [1e-300])
async def test_an_edge_top_p_is_served_and_fails_nobody_else(
    live: LiveServer, http: httpx.AsyncClient, engine: LLMEngine, top_p: float
) -> None:
    await add_tenant_b(live)
    faults = Faults().install(engine)  # records the forward passes; injects nothing

    async def attack() -> httpx.Response:
        return await completion(http, CHAT_TOKEN, messages=A_MESSAGES, max_tokens=8, temperature=1.0, top_p=top_p)

    completed, session_id, response, attacked = await tenant_b_reply_while(live, http, engine, attack)

    await assert_b_stored_complete(live, session_id, completed)
    assert_concurrent_call_ok(response)
    # A: a valid request, served; keeping only the most likely token makes it greedy.
    assert attacked.status_code == 200, attacked.text
    assert attacked.json()["choices"][0]["message"]["content"] == await greedy(engine, A_MESSAGES, 8)
    assert_shared_a_step(faults)


@pytest.mark.postgres
async def test_a_prompt_that_fails_the_model_fails_alone(
    live: LiveServer, http: httpx.AsyncClient, engine: LLMEngine
) -> None:
    await add_tenant_b(live)
    others = set(engine.tokenize(f"{DEFAULT_SYSTEM_PROMPT} {B_TEXT} {C_MESSAGES[0]['content']}"))
    poison = sorted(set(engine.tokenize(A_MESSAGES[0]["content"])) - others)[0]
    faults = Faults(forward_tokens={poison}).install(engine)

    async def attack() -> httpx.Response:
        return await completion(http, CHAT_TOKEN, messages=A_MESSAGES, max_tokens=8)

    try:
        completed, session_id, response, attacked = await tenant_b_reply_while(live, http, engine, attack)
    finally:
        faults.clear()

    assert attacked.status_code == 500, attacked.text
    assert attacked.json()["error"] == {
        "message": "internal engine error (see the server log)",
        "type": "server_error",
        "param": None,
        "code": "engine_error",
    }
    await assert_b_stored_complete(live, session_id, completed)
    assert_concurrent_call_ok(response)
    assert_shared_a_step(faults)
    assert engine.stats().kv.num_used_blocks == 0
