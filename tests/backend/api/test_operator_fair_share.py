"""The operator's per-tenant weight and quotas (``/admin/fair-share/{tenant}``) through a real server on Postgres:
stored, applied to the next request (429 ``rate_limited`` with Retry-After), audited, and counted per tenant in
``/metrics``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from backend.core.errors import engine_error_code
from backend.core.tenant_quota import RateLimited
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TOKEN = "test-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"Authorization": f"Bearer {CHAT_TOKEN}"}
BODY = {"model": "default", "messages": [{"role": "user", "content": "Where is my order?"}], "max_tokens": 3}
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path, operator_token=TOKEN), tiny_engine) as server:
        yield server


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_the_operator_sets_a_quota_and_the_tenant_is_limited_by_it(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        tenant = (await http.get("/admin/tenant", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()["id"]
        default = await http.get(f"/admin/fair-share/{tenant}", headers=OPERATOR)
        put = await http.put(
            f"/admin/fair-share/{tenant}", headers=OPERATOR, json={"weight": 2.0, "tokens_per_minute": 1}
        )
        stored = await http.get(f"/admin/fair-share/{tenant}", headers=OPERATOR)
        first = await http.post("/v1/chat/completions", json=BODY, headers=CHAT)
        second = await http.post("/v1/chat/completions", json=BODY, headers=CHAT)
        metrics = (await http.get("/metrics")).text
        reset = await http.delete(f"/admin/fair-share/{tenant}", headers=OPERATOR)
        third = await http.post("/v1/chat/completions", json=BODY, headers=CHAT)
        trail = (await http.get("/admin/cache/audit", headers=OPERATOR)).json()

    assert default.json() == {"tenant_id": tenant, "weight": 1.0, "tokens_per_minute": None, "max_concurrent": None}
    assert put.status_code == 200, put.text
    assert stored.json() == {"tenant_id": tenant, "weight": 2.0, "tokens_per_minute": 1, "max_concurrent": None}
    assert first.status_code == 200, first.text  # under the limit when it started: it runs to the end
    assert second.status_code == 429, second.text
    assert 1 <= int(second.headers["retry-after"]) <= 60
    error = second.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "rate_limited")
    assert error["message"].startswith("rate limited: ")
    assert "(limit 1)" in error["message"]
    assert reset.json() == default.json()
    assert third.status_code == 200, third.text

    usage = first.json()["usage"]
    served = _samples(metrics, "kvchat:tenant_served_tokens_total")
    assert served[(("kind", "completion"), ("tenant", tenant))] == usage["completion_tokens"]
    assert served[(("kind", "prompt"), ("tenant", tenant))] >= 1
    refusals = _samples(metrics, "kvchat:tenant_refusals_total")
    assert refusals == {(("reason", "tokens_per_minute"), ("tenant", tenant)): 1.0}
    assert _samples(metrics, "kvchat:tenant_queue_seconds_count") == {(("tenant", tenant),): 1.0}
    assert [(r["action"], r["result"]) for r in trail][:2] == [
        ("tenant.fair_share.reset", "ok"),
        ("tenant.fair_share", "ok"),
    ]


async def test_max_concurrent_refuses_the_request_over_it(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        tenant = (await http.get("/admin/tenant", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()["id"]
        await http.put(f"/admin/fair-share/{tenant}", headers=OPERATOR, json={"max_concurrent": 1})
        long = {**BODY, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/chat/completions", json=long, headers=CHAT) as streaming:
            assert streaming.status_code == 200
            refused = await http.post("/v1/chat/completions", json=BODY, headers=CHAT)
        after = await http.post("/v1/chat/completions", json=BODY, headers=CHAT)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "1 requests of this tenant are in flight" in refused.json()["error"]["message"]
    assert after.status_code == 200, after.text  # the stream's slot was released when it ended


@pytest.mark.parametrize(
    ("body", "status"),
    [({"weight": 0}, 422), ({"weight": 2, "max_concurrent": 0}, 422), ({"weight": 1, "extra": 1}, 422)],
)
async def test_invalid_values_are_refused(live: LiveServer, body: dict[str, float], status: int) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        tenant = (await http.get("/admin/tenant", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()["id"]
        response = await http.put(f"/admin/fair-share/{tenant}", headers=OPERATOR, json=body)
    assert response.status_code == status, response.text


async def test_an_unknown_tenant_is_404_and_a_tenant_key_is_not_the_operator(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        missing = await http.put("/admin/fair-share/no-such-tenant", headers=OPERATOR, json={"weight": 3})
        as_tenant = await http.put(
            "/admin/fair-share/x", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, json={"weight": 3}
        )
    assert (missing.status_code, missing.json()["code"]) == (404, "tenant_not_found")
    assert as_tenant.status_code == 401


def test_a_rate_limited_turn_is_the_rate_limited_frame_code() -> None:
    assert engine_error_code(RateLimited("rate limited: x", 2.0, "max_concurrent")) == "rate_limited"


async def test_a_chat_turn_over_the_quota_gets_a_rate_limited_frame(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        tenant = (await http.get("/admin/tenant", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()["id"]
        await http.put(f"/admin/fair-share/{tenant}", headers=OPERATOR, json={"tokens_per_minute": 1})
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello(CHAT_TOKEN)
        first = await chat.turn("Where is my order?")  # under the limit when it started
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "second", "text": "And now?"}))
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 60))]
        while frames[-1]["type"] not in ("error", "message.completed"):
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    assert first["usage"]["completion_tokens"] >= 1
    errors = [f for f in frames if f["type"] == "error"]
    assert frames[0] == {"type": "message.ack", "client_msg_id": "second", "seq": 3, "duplicate": False}
    assert [(e["code"], e["client_msg_id"]) for e in errors] == [("rate_limited", "second")]
    assert 1 <= errors[0]["retry_after_ms"] <= 60_000
    assert errors[0]["message"].startswith("rate limited: ")
