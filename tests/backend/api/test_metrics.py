"""/metrics through a real server: it parses with prometheus-client's own parser and moves with a scripted chat."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from backend.core.config import Settings
from backend.main import create_app
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio
TIMEOUT = 30.0


async def _scrape(live: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(base_url=live.http) as http:
        resp = await http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def _chat_turn(live: LiveServer) -> str:
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id: str = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["session_id"]
        await ws.send("{not json")
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": "Where is my order?"}))
        while json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"] != "message.completed":
            pass
    return session_id


async def _api_call(live: LiveServer) -> None:
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there"}]}
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        resp = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {CHAT_TOKEN}"})
    assert resp.status_code == 200


async def test_metrics_parse_and_move_with_a_scripted_chat(
    sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    with serving(server_settings(sqlite_url, tmp_path), tiny_engine) as live:
        before = await _scrape(live)
        session_id = await _chat_turn(live)
        await _api_call(live)
        await _api_call(live)  # the same prompt again: a prefix-cache hit
        await asyncio.sleep(0.2)  # the socket's close is counted after the client sees it
        after = await _scrape(live)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("kvchat:request_success_total") >= 3
    assert moved("kvchat:prefix_cache_queries_total") > 0
    assert moved("kvchat:prefix_cache_hits_total") > 0
    assert moved("kvchat:generation_tokens_total") > 0
    assert moved("kvchat:time_to_first_token_seconds_count") >= 2
    assert moved("kvchat:inter_token_latency_seconds_count") >= 2
    assert moved("kvchat:errors_total", (("code", "bad_json"),)) == 1
    assert moved("kvchat:db_query_duration_seconds_count") > 0
    assert moved("kvchat:prefix_cache_queries_by_type_total", (("block_type", "system_prompt"),)) > 0
    hits_by_type = {
        labels: v for (name, labels), v in after.items() if name == "kvchat:prefix_cache_hits_by_type_total"
    }
    assert sum(hits_by_type.values()) == after[("kvchat:prefix_cache_hits_total", ())]  # by type adds up
    assert after[("kvchat:ws_open_sockets", ())] == 0
    assert after[("kvchat:kv_cache_bytes", (("state", "capacity"), ("tier", "memory")))] > 0
    assert 0.0 <= after[("kvchat:kv_cache_usage_perc", ())] <= 1.0
    assert after[("kvchat:engine_threads", ())] >= 1  # (the width of its steps: engine/cpu_share.py)
    assert after[("kvchat:engine_width_changes_total", ())] >= 0
    # NOTE: no identifiers in labels: a series per session would leak who uses the service. The fair-share series
    # are the one exception, by tenant id only (backend/core/metrics.py says why).
    label_values = {value for _, labels in after for _, value in labels}
    assert session_id not in label_values
    tenant_series = {name for name, _ in after if name.startswith("kvchat:tenant_")}
    assert tenant_series >= {"kvchat:tenant_served_tokens_total", "kvchat:tenant_queue_seconds_count"}
    others = {value for name, labels in after if name not in tenant_series for _, value in labels}
    assert all(len(value) < 32 for value in others), others
    tenants = {value for name, labels in after if name in tenant_series for key, value in labels if key == "tenant"}
    assert len(tenants) == 1


async def _metrics_status(
    settings: Settings, engine: LLMEngine, client: tuple[str, int], headers: dict[str, str]
) -> int:
    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvchat") as http:
            return (await http.get("/metrics", headers=headers)).status_code


@pytest.mark.parametrize(
    ("token", "client", "headers", "status"),
    [
        (None, ("127.0.0.1", 5000), {}, 200),
        (None, ("::1", 5000), {}, 200),
        (None, ("10.0.0.7", 5000), {}, 403),  # no operator token: nobody off this machine
        ("op-secret", ("10.0.0.7", 5000), {"Authorization": "Bearer op-secret"}, 200),
        ("op-secret", ("127.0.0.1", 5000), {}, 401),  # with a token, even loopback must send it
        ("op-secret", ("10.0.0.7", 5000), {"Authorization": f"Bearer {CHAT_TOKEN}"}, 401),
        ("op-secret", ("10.0.0.7", 5000), {"X-API-Key": ADMIN_KEY}, 401),  # a tenant's admin key is not the token
    ],
)
async def test_metrics_are_for_the_operator_only(
    tmp_path: Path,
    tiny_engine: LLMEngine,
    token: str | None,
    client: tuple[str, int],
    headers: dict[str, str],
    status: int,
) -> None:
    settings = Settings(data_dir=tmp_path, metrics_token=token, bootstrap_admin_key=ADMIN_KEY)
    assert await _metrics_status(settings, tiny_engine, client, headers) == status
