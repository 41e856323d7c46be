"""A tenant's policy text, cache namespace and prefix pin, through a real server on Postgres with two real tenants.

- the system prompt and the policy text open every prompt, the same ids turn after turn (and they are what is pinned);
- editing either flushes the tenant's namespace (every block depends on them), and only the tenant's;
- the namespace is derived on the server (HMAC of the tenant under the secret): the same after a restart, another
  under another secret, shared only through the public opt-in, never chosen by a client;
- pinning: on, re-pinned on an edit and at start, refused over the operator's share, only ever the tenant's own;
- the chat hands the engine each session's temperature; deleting a session erases its blocks and says how many.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from test_admin_cache import connect

from backend.core.namespaces import SECRET_FILE, CacheScope, cache_namespace
from backend.db.models import InvalidationEvent
from backend.domain import KeyKind
from backend.services import cache_admin, tenants
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session, free_port, server_settings, serving
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 60
A = {"X-API-Key": ADMIN_KEY}
POLICY = "Returns: within 30 days with the receipt. Refunds go to the original payment method."
PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"


async def one_turn(live: LiveServer, token: str, text: str) -> tuple[str, dict[str, Any]]:
    async with connect(live) as ws:
        chat = Chat(ws)
        session_id = await chat.hello(token)
        return session_id, await chat.turn(text)


async def second_tenant(live: LiveServer) -> tuple[str, str, str]:
    """Tenant B (the same default system prompt as A): its (id, chat token, admin key)."""
    async with db_session(live) as db:
        tenant = await tenants.create_tenant(db, f"tenant-b-{uuid.uuid4().hex[:6]}")
        chat = await tenants.issue_key(db, tenant.id, KeyKind.CHAT)
        admin = await tenants.issue_key(db, tenant.id, KeyKind.ADMIN)
        await db.commit()
    return tenant.id, chat.key, admin.key


async def tenant_of(live: LiveServer, admin: dict[str, str]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=live.http) as http:
        body: dict[str, Any] = (await http.get("/admin/tenant", headers=admin)).json()
    return body


def secret_of(live: LiveServer) -> bytes:
    return (live.settings.data_dir / SECRET_FILE).read_bytes().strip()


def prompt_ids(live: LiveServer, session_id: str) -> list[int]:
    last = live.state.chat.context.last_prompt(session_id)
    assert last is not None
    return list(last.token_ids)


class Spy:
    """Records the calls of one engine method (and still makes them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, name: str) -> None:
        self.calls: list[tuple[Any, ...]] = []
        real = getattr(engine, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(args + tuple(kwargs.values()))
            return real(*args, **kwargs)

        monkeypatch.setattr(engine, name, spy)


# ---------------------------------------------------------------------- part 1: system prompt + policy text


async def test_the_system_prompt_and_policy_open_every_prompt_with_the_same_ids(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    block = tiny_engine.info.block_size
    async with httpx.AsyncClient(base_url=live.http) as http:
        set_policy = await http.put("/admin/tenant/policy-text", headers=A, json={"policy_text": POLICY})
    assert set_policy.status_code == 200, set_policy.text
    tenant = set_policy.json()
    assert tenant["policy_text"] == POLICY and tenant["cache_scope"] == "private" and tenant["pin_prefix"] is False
    prefix = cache_admin.prefix_token_ids(tiny_engine, tenant["system_prompt"], POLICY)
    assert POLICY in tiny_engine.tokenizer.decode(prefix)
    async with connect(live) as ws, httpx.AsyncClient(base_url=live.http) as http:
        chat = Chat(ws)
        session_id = await chat.hello(CHAT_TOKEN)
        await chat.turn(PARCEL)
        first = prompt_ids(live, session_id)
        second_turn = await chat.turn("Any news about it?")
        second = prompt_ids(live, session_id)
        pinned = await http.put(f"/admin/sessions/{session_id}/context", headers=A, json={"pinned_context": "VIP"})
        assert pinned.status_code == 200
        await chat.turn("Thanks. And the refund?")
        third = prompt_ids(live, session_id)  # part 2 now follows part 1 in the same system message
    for ids in (first, second, third):
        assert ids[: len(prefix)] == prefix
    assert second_turn["usage"]["cached_tokens"] >= (len(prefix) // block) * block
    # the pinned-context edit freed from the end of part 1 on: part 1 stayed cached
    assert live.state.chat.context.last_prompt(session_id).context_from == len(prefix)


async def test_editing_the_policy_flushes_the_tenants_namespace_and_no_other(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    tenant_b, chat_b, _ = await second_tenant(live)
    tenant_a = (await tenant_of(live, A))["id"]
    async with connect(live) as ws_a, connect(live) as ws_b, httpx.AsyncClient(base_url=live.http) as http:
        a, b = Chat(ws_a), Chat(ws_b)
        await a.hello(CHAT_TOKEN)
        await b.hello(chat_b)
        await a.turn(PARCEL)
        await b.turn(PARCEL)
        before = tiny_engine.stats().cache.invalidations.get("tenant_prompt_edited")
        edited = await http.put("/admin/tenant/policy-text", headers=A, json={"policy_text": POLICY})
        assert edited.status_code == 200, edited.text
        after = tiny_engine.stats().cache.invalidations["tenant_prompt_edited"]
        a2 = await a.turn("Any news about it?")
        b2 = await b.turn("Any news about it?")
    freed = after.blocks_freed - (before.blocks_freed if before else 0)
    assert freed >= 1
    async with db_session(live) as db:
        rows = await db.execute(select(InvalidationEvent).where(InvalidationEvent.reason == "tenant_prompt_edited"))
        events = [(e.tenant_id, e.session_id, e.actor, e.blocks_freed) for e in rows.scalars()]
    assert events == [(tenant_a, None, "admin", freed)]
    assert a2["usage"]["cached_tokens"] == 0  # A's namespace was emptied, and its prompt changed from part 1 on
    assert b2["usage"]["cached_tokens"] > 0  # B's blocks were never A's to flush
    assert tenant_b != tenant_a


# ---------------------------------------------------------------------- namespaces


async def test_every_engine_call_carries_the_namespace_the_server_derived(
    live: LiveServer, tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id = (await tenant_of(live, A))["id"]
    expected = cache_namespace(tenant_id, secret_of(live), CacheScope.PRIVATE)
    requests = Spy(monkeypatch, tiny_engine, "generate")
    invalidations = Spy(monkeypatch, tiny_engine, "invalidate")
    erasures = Spy(monkeypatch, tiny_engine, "erase_session")
    session_id, _ = await one_turn(live, CHAT_TOKEN, PARCEL)
    body = {
        "model": "default",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": PARCEL}],
        # NOTE: what a client might try: none of it reaches the namespace
        "user": "tenant-b",
        "cache_salt": "chosen-by-the-client",
        "namespace": "public",
    }
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        resp = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {CHAT_TOKEN}"})
        assert resp.status_code == 200, resp.text
        assert (await http.post(f"/admin/sessions/{session_id}/flush", headers=A)).status_code == 200
        assert (await http.delete(f"/admin/sessions/{session_id}", headers=A)).status_code == 200
    assert [call[2] for call in requests.calls] == [expected, expected]
    assert [call[0] for call in invalidations.calls] == [expected]
    assert erasures.calls == [(session_id, expected)]
    assert expected != tenant_id


async def test_a_restart_keeps_the_namespace_and_another_secret_changes_it(
    pg_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    settings = server_settings(pg_url, tmp_path)
    with serving(settings, tiny_engine) as first:
        tenant_id = (await tenant_of(first, A))["id"]
        ns_first = first.state.namespaces.of(tenant_id, CacheScope.PRIVATE)
        _, cold = await one_turn(first, CHAT_TOKEN, PARCEL)
    with serving(settings.model_copy(update={"port": free_port()}), tiny_engine) as again:
        assert again.state.namespaces.of(tenant_id, CacheScope.PRIVATE) == ns_first
        _, warm = await one_turn(again, CHAT_TOKEN, PARCEL)
    other = settings.model_copy(update={"port": settings.port + 2, "secret_key": "another-secret"})
    with serving(other, tiny_engine) as rekeyed:
        assert rekeyed.state.namespaces.of(tenant_id, CacheScope.PRIVATE) != ns_first
        _, elsewhere = await one_turn(rekeyed, CHAT_TOKEN, PARCEL)
    assert cold["usage"]["cached_tokens"] == 0
    assert warm["usage"]["cached_tokens"] > 0  # the same namespace: the cache of before the restart is reused
    assert elsewhere["usage"]["cached_tokens"] == 0  # another secret: another namespace, nothing reused


async def test_tenants_share_cached_blocks_only_through_the_public_opt_in(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    _, chat_b, admin_b = await second_tenant(live)
    b = {"X-API-Key": admin_b}
    text = "Hello, my jacket arrived torn at the seam and I would like a new one please."
    _, a1 = await one_turn(live, CHAT_TOKEN, text)
    _, b1 = await one_turn(live, chat_b, text)  # the very same prompt as A's, in B's own namespace
    async with httpx.AsyncClient(base_url=live.http) as http:
        bad = await http.put("/admin/tenant/cache", headers=b, json={"cache_scope": "shared", "pin_prefix": False})
        for admin in (A, b):
            resp = await http.put(
                "/admin/tenant/cache", headers=admin, json={"cache_scope": "public", "pin_prefix": False}
            )
            assert resp.json() == {
                "cache_scope": "public",
                "pin_prefix": False,
                "replica_erase": "report",  # (omitted: the default)
                "pinned_blocks": None,
                "pinned_cached": None,
                "pinned_replicas": [],
            }
        flush = await http.post("/admin/tenant/flush", headers=b)
        scope = (await http.get("/admin/tenant/cache", headers=b)).json()["cache_scope"]
    assert bad.status_code == 422
    _, a2 = await one_turn(live, CHAT_TOKEN, text)
    _, b2 = await one_turn(live, chat_b, text)
    assert (a1["usage"]["cached_tokens"], b1["usage"]["cached_tokens"]) == (0, 0)
    assert a2["usage"]["cached_tokens"] == 0  # the public namespace was new to A too
    assert b2["usage"]["cached_tokens"] >= tiny_engine.info.block_size  # B reuses what A computed there
    assert (flush.status_code, flush.json()["code"]) == (409, "namespace_shared")  # B cannot flush A's blocks
    assert scope == "public"


# ---------------------------------------------------------------------- pinning


async def test_pinning_the_prefix_follows_edits_restarts_and_the_operators_share(
    live: LiveServer, tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = tiny_engine.info.block_size
    _, _, admin_b = await second_tenant(live)
    tenant = await tenant_of(live, A)
    namespace = cache_namespace(tenant["id"], secret_of(live), CacheScope.PRIVATE)
    pins, unpins = Spy(monkeypatch, tiny_engine, "pin_prefix"), Spy(monkeypatch, tiny_engine, "unpin")
    before = tiny_engine.cache_settings()
    try:
        async with httpx.AsyncClient(base_url=live.http) as http:
            on = await http.put("/admin/tenant/cache", headers=A, json={"cache_scope": "private", "pin_prefix": True})
            prefix = cache_admin.prefix_token_ids(tiny_engine, tenant["system_prompt"], "")
            assert on.status_code == 200, on.text
            assert on.json()["pinned_blocks"] == len(prefix) // block >= 1
            assert pins.calls == [(namespace, prefix)]

            await http.put("/admin/tenant/policy-text", headers=A, json={"policy_text": POLICY})
            repinned = cache_admin.prefix_token_ids(tiny_engine, tenant["system_prompt"], POLICY)
            assert pins.calls[-1] == (namespace, repinned)

            b_off = await http.put(
                "/admin/tenant/cache",
                headers={"X-API-Key": admin_b},
                json={"cache_scope": "private", "pin_prefix": False},
            )
            assert b_off.status_code == 200
            assert all(call[0] != namespace for call in unpins.calls)  # B's key never reaches A's pin

        pins.calls.clear()
        with serving(live.settings.model_copy(update={"port": free_port()}), tiny_engine):
            assert pins.calls == [(namespace, repinned)]  # pinned again at start

        async with httpx.AsyncClient(base_url=live.http) as http:
            off = await http.put("/admin/tenant/cache", headers=A, json={"cache_scope": "private", "pin_prefix": False})
            assert off.json()["pin_prefix"] is False
            assert (namespace,) in unpins.calls
            tiny_engine.configure_cache(pin_max_fraction=0.0001)  # (the operator's share: less than one block)
            refused = await http.put(
                "/admin/tenant/cache", headers=A, json={"cache_scope": "private", "pin_prefix": True}
            )
            assert (refused.status_code, refused.json()["code"]) == (409, "pin_refused")
            assert "pinned share" in refused.json()["detail"]
            assert (await http.get("/admin/tenant/cache", headers=A)).json()["pin_prefix"] is False  # nothing stored
    finally:
        tiny_engine.unpin(namespace)
        tiny_engine.configure_cache(**before.as_dict())


# ---------------------------------------------------------------------- temperature and erasure


async def test_each_customer_message_hands_the_engine_its_sessions_temperature(
    live: LiveServer, tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    hints = Spy(monkeypatch, tiny_engine, "set_session_temperature")
    session_id, done = await one_turn(live, CHAT_TOKEN, PARCEL)
    assert hints.calls == [(session_id, done["topic"]["temperature"])]


async def test_deleting_a_session_erases_its_blocks_and_reports_them_by_tier(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    session_id, _ = await one_turn(live, CHAT_TOKEN, PARCEL)
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        footprint = (await http.get(f"/admin/sessions/{session_id}/detail", headers=A)).json()["cache_footprint"]
        deleted = await http.delete(f"/admin/sessions/{session_id}", headers=A)
        again = await http.delete(f"/admin/sessions/{session_id}", headers=A)
        audit = (await http.get("/admin/audit", headers=A)).json()
    assert deleted.status_code == 200, deleted.text
    erased = deleted.json()
    assert (erased["complete"], erased["replicas"]) == (True, [])  # the in-process engine: no replica to name
    assert erased["disk_blocks"] == 0  # the test engine has no disk tier
    assert 1 <= erased["memory_blocks"] <= footprint["blocks"]  # its own blocks; the shared system prompt stays
    assert (again.status_code, again.json()["code"]) == (404, "session_not_found")
    assert (audit[1]["action"], audit[1]["detail"]) == (
        "session.delete",
        f"erased {erased['memory_blocks']} memory and 0 disk blocks",
    )
    async with db_session(live) as db:
        rows = await db.execute(select(InvalidationEvent).where(InvalidationEvent.reason == "session_erased"))
        assert [(e.session_id, e.blocks_freed) for e in rows.scalars()] == [(None, erased["memory_blocks"])]
