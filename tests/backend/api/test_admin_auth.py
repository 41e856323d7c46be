"""Admin auth through a real server on Postgres, with two real tenants.

Every ``/admin`` route (read from the app's own OpenAPI schema, so a new route is covered the day it lands) refuses
a missing key, a wrong key and a chat token; a tenant's admin key never reads or changes another tenant's sessions,
and never reaches the operator's engine-global cache settings.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import KeyKind
from backend.services import tenants
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
OPERATOR_TOKEN = "test-operator-token"


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    # NOTE: with an operator token, the operator's /admin/cache routes refuse every tenant key too (unset, they answer
    # loopback clients, which every test client is)
    with serving(server_settings(pg_url, tmp_path, operator_token=OPERATOR_TOKEN), tiny_engine) as server:
        yield server


async def _second_tenant(live: LiveServer) -> tuple[str, str]:
    """Tenant B: returns its (chat token, admin key)."""
    engine = create_db_engine(live.settings.resolved_database_url)
    try:
        async with create_sessionmaker(engine)() as db:
            tenant = await tenants.create_tenant(db, "tenant-b")
            chat = await tenants.issue_key(db, tenant.id, KeyKind.CHAT)
            admin = await tenants.issue_key(db, tenant.id, KeyKind.ADMIN)
            await db.commit()
    finally:
        await engine.dispose()
    return chat.key, admin.key


async def _session_of(live: LiveServer, chat_token: str) -> str:
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": chat_token}))
        session_id: str = json.loads(await asyncio.wait_for(ws.recv(), 30))["session_id"]
    return session_id


def _admin_operations(schema: dict[str, object]) -> list[tuple[str, str]]:
    paths = schema["paths"]
    assert isinstance(paths, dict)
    ops = [(method.upper(), path) for path, item in paths.items() if path.startswith("/admin") for method in item]
    assert len(ops) >= 10, ops  # sessions, stats and tenant routes at least
    return ops


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "00000000-0000-0000-0000-000000000000", path)


async def test_every_admin_route_refuses_a_missing_wrong_or_chat_key(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        ops = _admin_operations((await http.get("/openapi.json")).json())
        for method, path in ops:
            for headers in ({}, {"X-API-Key": "kvc_admin_wrong"}, {"X-API-Key": CHAT_TOKEN}):
                resp = await http.request(method, _concrete(path), headers=headers, json={})
                assert resp.status_code == 401, (method, path, headers, resp.text)
                assert resp.json()["code"] == "unauthorized"
            bearer = await http.request(
                method, _concrete(path), headers={"Authorization": f"Bearer {CHAT_TOKEN}"}, json={}
            )
            assert bearer.status_code == 401, (method, path)


async def test_a_tenant_admin_never_reaches_another_tenants_sessions(live: LiveServer) -> None:
    chat_b, admin_b = await _second_tenant(live)
    session_a = await _session_of(live, CHAT_TOKEN)
    session_b = await _session_of(live, chat_b)
    b = {"X-API-Key": admin_b}
    async with httpx.AsyncClient(base_url=live.http) as http:
        for method, path, body in [
            ("GET", f"/admin/sessions/{session_a}", None),
            ("GET", f"/admin/sessions/{session_a}/transcript", None),
            ("POST", f"/admin/sessions/{session_a}/status", {"status": "closed"}),
            ("DELETE", f"/admin/sessions/{session_a}", None),
        ]:
            resp = await http.request(method, path, headers=b, json=body)
            assert resp.status_code == 404, (method, path, resp.text)
            assert resp.json()["code"] == "session_not_found"
        listed_b = {s["id"] for s in (await http.get("/admin/sessions", headers=b)).json()}
        listed_a = {s["id"] for s in (await http.get("/admin/sessions", headers={"X-API-Key": ADMIN_KEY})).json()}
        still_a = await http.get(f"/admin/sessions/{session_a}", headers={"X-API-Key": ADMIN_KEY})
    assert listed_b == {session_b}
    assert session_a in listed_a and session_b not in listed_a
    assert still_a.json()["status"] == "bot_active"  # B's close and delete changed nothing


async def test_key_rotation_shows_the_new_key_once_and_revokes_the_old(live: LiveServer) -> None:
    chat_b, admin_b = await _second_tenant(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        rotated = await http.post("/admin/tenant/keys/rotate", headers={"X-API-Key": admin_b}, json={"kind": "chat"})
        assert rotated.status_code == 200
        new_chat = rotated.json()["key"]
        assert new_chat.startswith("kvc_chat_") and new_chat != chat_b
        keys = (await http.get("/admin/tenant/keys", headers={"X-API-Key": admin_b})).json()
        assert all(new_chat not in json.dumps(k) for k in keys)  # listed by prefix only
        assert [k["revoked_at"] is None for k in keys if k["kind"] == "chat"].count(True) == 1
        old = await http.get("/v1/models", headers={"Authorization": f"Bearer {chat_b}"})
        new = await http.get("/v1/models", headers={"Authorization": f"Bearer {new_chat}"})
        a_still = await http.get("/v1/models", headers={"Authorization": f"Bearer {CHAT_TOKEN}"})
        prompt = await http.put(
            "/admin/tenant/system-prompt", headers={"X-API-Key": admin_b}, json={"system_prompt": "Be brief."}
        )
        a_tenant = await http.get("/admin/tenant", headers={"X-API-Key": ADMIN_KEY})
    assert (old.status_code, new.status_code, a_still.status_code) == (401, 200, 200)
    assert prompt.json()["system_prompt"] == "Be brief."
    assert a_tenant.json()["system_prompt"] != "Be brief."


async def test_only_the_operator_reaches_the_engine_wide_cache_settings(live: LiveServer) -> None:
    _, admin_b = await _second_tenant(live)
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    before = live.state.engine.cache_settings()
    async with httpx.AsyncClient(base_url=live.http) as http:
        for key in (ADMIN_KEY, admin_b):
            for headers in ({"X-API-Key": key}, {"Authorization": f"Bearer {key}"}):
                read = await http.get("/admin/cache/settings", headers=headers)
                write = await http.put("/admin/cache/settings", headers=headers, json={"memory_ttl_s": 1.0})
                audit = await http.get("/admin/cache/audit", headers=headers)
                assert (read.status_code, write.status_code, audit.status_code) == (401, 401, 401)
                assert write.json()["code"] == "unauthorized"
        ok = await http.get("/admin/cache/settings", headers=operator)
        trail = (await http.get("/admin/cache/audit", headers=operator)).json()
        tenant_trail = (await http.get("/admin/audit", headers={"X-API-Key": ADMIN_KEY})).json()
    assert ok.status_code == 200 and ok.json()["memory_ttl_s"] == before.memory_ttl_s
    assert live.state.engine.cache_settings() == before  # no tenant's write went through
    assert trail == []  # refused before anyone was known: nothing to file
    assert all(r["action"] != "cache.settings" for r in tenant_trail)
