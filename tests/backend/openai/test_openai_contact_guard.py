"""The contact guard on ``/v1`` end to end (real server, the official ``openai`` client, the tiny model held by a
grammar to a reply with an invented URL and phone number: ``support/forced_engine.py``): off by default, the raw
reply comes back; with the tenant's ``v1_contact_guard`` on, the whole and the streamed completion come back without
them (the tenant's own URL and the customer's order number pass), and no chunk carries a piece of them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from engine.config import EngineConfig
from support.forced_engine import ForcedReplyEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

POLICY = "Returns within 30 days: https://shop.example.com/returns."
FORCED = "Return it at https://shop.example.com/returns or www.fake-returns.com, order 302-1234567, or call 1082567394."
SHOWN = "Return it at https://shop.example.com/returns or [link removed], order 302-1234567, or call [number removed]."
MESSAGES = [{"role": "user", "content": "My blender arrived with a cracked jug. Order 302-1234567."}]


@pytest.fixture(scope="module")
def forced_engine(tiny_model_dir: Path) -> Iterator[ForcedReplyEngine]:
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_kv_memory_mb=8, max_num_seqs=4)
    engine = ForcedReplyEngine(config)
    engine.forced = FORCED
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture
def live(sqlite_url: str, tmp_path: Path, forced_engine: ForcedReplyEngine) -> Iterator[LiveServer]:
    with serving(server_settings(sqlite_url, tmp_path), forced_engine) as server:
        yield server


async def _replies(live: LiveServer) -> tuple[str | None, list[str]]:
    """The whole completion's content, and the streamed one's content chunks."""
    async with AsyncOpenAI(base_url=f"{live.http}/v1", api_key=CHAT_TOKEN, max_retries=0, timeout=30.0) as client:
        whole = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=256)  # type: ignore[arg-type]
        stream = await client.chat.completions.create(
            model="default",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=256,
            stream=True,
        )
        chunks = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    return whole.choices[0].message.content, chunks


async def _set_guard(live: LiveServer, enabled: bool) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=live.http, headers={"X-API-Key": ADMIN_KEY}) as http:
        assert (await http.put("/admin/tenant/policy-text", json={"policy_text": POLICY})).status_code == 200
        r = await http.put("/admin/tenant/v1-contact-guard", json={"enabled": enabled})
        assert r.status_code == 200
        return dict(r.json())


async def test_off_by_default_the_raw_reply_comes_back(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, headers={"X-API-Key": ADMIN_KEY}) as http:
        assert (await http.get("/admin/tenant")).json()["v1_contact_guard"] is False
    whole, chunks = await _replies(live)
    assert whole == "".join(chunks) == FORCED


async def test_on_the_invented_contacts_never_come_back(live: LiveServer) -> None:
    assert (await _set_guard(live, True))["v1_contact_guard"] is True
    whole, chunks = await _replies(live)
    assert whole == "".join(chunks) == SHOWN
    for chunk in chunks:
        for piece in ("www", "fake", "1082", "567394"):
            assert piece not in chunk
    async with httpx.AsyncClient(base_url=live.http) as http:
        metrics = (await http.get("/metrics")).text
    assert 'kvchat:contacts_blocked_total{kind="url"} 2.0' in metrics  # the whole completion's and the stream's
    assert 'kvchat:contacts_blocked_total{kind="phone"} 2.0' in metrics
    assert (await _set_guard(live, False))["v1_contact_guard"] is False
    whole, chunks = await _replies(live)
    assert whole == "".join(chunks) == FORCED


async def test_on_logprobs_are_refused(live: LiveServer) -> None:
    """The logprobs would carry the tokens of what the guard leaves out."""
    await _set_guard(live, True)
    async with httpx.AsyncClient(base_url=live.http, headers={"Authorization": f"Bearer {CHAT_TOKEN}"}) as http:
        body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, "logprobs": True}
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "logprobs are not available while the tenant's contact guard is on",
        "type": "invalid_request_error",
        "param": "logprobs",
        "code": "invalid_request",
    }


async def test_the_setting_is_audited_and_refuses_extra_fields(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, headers={"X-API-Key": ADMIN_KEY}) as http:
        r = await http.put("/admin/tenant/v1-contact-guard", json={"enabled": True, "also": 1})
        assert r.status_code == 422
        r = await http.put("/admin/tenant/v1-contact-guard", json={"enabled": True})
        assert r.status_code == 200
        audit = (await http.get("/admin/audit")).json()
    assert [e["action"] for e in audit][:1] == ["tenant.v1_contact_guard"]
