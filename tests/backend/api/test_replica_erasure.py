"""Issue 46 through a real server on Postgres whose engine is a stand-in vLLM replica (``KVCHAT_ENGINE_URL``; no
``/kvchat/*`` routes, ``support/vllm_standin.py``): an erasure that the replica cannot do answers 207 and names it,
in the response and in the audit row, and the session's rows are gone all the same; with the tenant's
``replica_erase`` at ``reset_cache`` the replica receives the prefix-cache reset and the erasure is complete; a
flush, a pin and a pinned-context edit name the replica as well."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving
from support.vllm_standin import VllmStandIn
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

A = {"X-API-Key": ADMIN_KEY}
RESET = "/reset_prefix_cache?reset_running_requests=true"
NO_ERASE = "vLLM has no per-session erase"


@pytest.fixture
def vllm(tiny_model_dir: Path) -> Iterator[VllmStandIn]:
    standin = VllmStandIn(str(tiny_model_dir), dev_mode=True)
    yield standin
    standin.stop()


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_model_dir: Path, vllm: VllmStandIn) -> Iterator[LiveServer]:
    settings = server_settings(pg_url, tmp_path / "data", engine_url=vllm.url, model=str(tiny_model_dir))
    with serving(settings, None) as server:
        yield server


async def _session_with_a_turn(live: LiveServer) -> str:
    async with websockets.connect(live.ws, open_timeout=30) as ws:
        chat = Chat(ws)
        session_id = await chat.hello(CHAT_TOKEN)
        await chat.turn("Where is my parcel? Order #4061234567.")
    return session_id


async def _last_audit(http: httpx.AsyncClient) -> dict[str, Any]:
    row: dict[str, Any] = (await http.get("/admin/audit", headers=A, params={"limit": 1})).json()[0]
    return row


async def test_an_erasure_the_vllm_replica_cannot_do_answers_207_and_names_it(
    live: LiveServer, vllm: VllmStandIn
) -> None:
    session_id = await _session_with_a_turn(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        deleted = await http.delete(f"/admin/sessions/{session_id}", headers=A)
        gone = await http.get(f"/admin/sessions/{session_id}", headers=A)
        audit = await _last_audit(http)
    assert deleted.status_code == 207, deleted.text
    assert deleted.json() == {
        "complete": False,
        "replicas": [{"replica": vllm.url, "outcome": "unsupported", "detail": NO_ERASE}],
        "memory_blocks": 0,
        "disk_blocks": 0,
    }
    assert gone.status_code == 404  # the rows are erased all the same
    assert (audit["action"], audit["target"], audit["result"], audit["detail"]) == (
        "session.delete",
        session_id,
        "incomplete",
        f"erased 0 memory and 0 disk blocks; not erased on {vllm.url} (unsupported: {NO_ERASE})",
    )
    assert vllm.received("POST", RESET) == 0  # the tenant did not choose the reset


async def test_with_reset_cache_the_erasure_resets_the_vllm_replicas_prefix_cache(
    live: LiveServer, vllm: VllmStandIn
) -> None:
    choice = {"cache_scope": "private", "pin_prefix": False, "replica_erase": "reset_cache"}
    async with httpx.AsyncClient(base_url=live.http) as http:
        chosen = await http.put("/admin/tenant/cache", headers=A, json=choice)
        assert (chosen.status_code, chosen.json()["replica_erase"]) == (200, "reset_cache"), chosen.text
        assert (await http.get("/admin/tenant/cache", headers=A)).json()["replica_erase"] == "reset_cache"
    session_id = await _session_with_a_turn(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        deleted = await http.delete(f"/admin/sessions/{session_id}", headers=A)
        audit = await _last_audit(http)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["complete"] is True
    assert deleted.json()["replicas"] == [
        {"replica": vllm.url, "outcome": "cache_reset", "detail": "its whole prefix cache, every session's"}
    ]
    assert vllm.received("POST", RESET) == 1
    assert (audit["action"], audit["result"], audit["detail"]) == (
        "session.delete",
        "ok",
        f"erased 0 memory and 0 disk blocks; reset the whole prefix cache of {vllm.url}",
    )


async def test_with_reset_cache_a_vllm_without_dev_mode_is_still_named(live: LiveServer, vllm: VllmStandIn) -> None:
    vllm.dev_mode = False
    choice = {"cache_scope": "private", "pin_prefix": False, "replica_erase": "reset_cache"}
    session_id = await _session_with_a_turn(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        await http.put("/admin/tenant/cache", headers=A, json=choice)
        deleted = await http.delete(f"/admin/sessions/{session_id}", headers=A)
    assert deleted.status_code == 207, deleted.text
    assert deleted.json()["replicas"] == [
        {
            "replica": vllm.url,
            "outcome": "unsupported",
            "detail": "no /reset_prefix_cache: vLLM serves it with VLLM_SERVER_DEV_MODE=1",
        }
    ]
    assert vllm.received("POST", RESET) == 1


async def test_a_flush_the_vllm_replica_cannot_do_names_it(live: LiveServer, vllm: VllmStandIn) -> None:
    session_id = await _session_with_a_turn(live)
    nothing = "vLLM has no per-session or per-namespace cache control"
    async with httpx.AsyncClient(base_url=live.http) as http:
        session = await http.post(f"/admin/sessions/{session_id}/flush", headers=A)
        session_audit = await _last_audit(http)
        tenant = await http.post("/admin/tenant/flush", headers=A)
    for flushed in (session, tenant):
        assert flushed.status_code == 207, flushed.text
        assert flushed.json() == {
            "complete": False,
            "replicas": [{"replica": vllm.url, "outcome": "unsupported", "detail": nothing}],
            "blocks_freed": 0,
            "tokens_freed": 0,
        }
    assert (session_audit["result"], session_audit["detail"]) == (
        "incomplete",
        f"freed 0 blocks (0 tokens) of the session; not flushed on {vllm.url} (unsupported: {nothing})",
    )


async def test_a_pin_and_a_pinned_context_edit_name_the_vllm_replica(live: LiveServer, vllm: VllmStandIn) -> None:
    session_id = await _session_with_a_turn(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        pinned = await http.put("/admin/tenant/cache", headers=A, json={"cache_scope": "private", "pin_prefix": True})
        pin_audit = await _last_audit(http)
        edited = await http.put(f"/admin/sessions/{session_id}/context", headers=A, json={"pinned_context": "VIP"})
    assert pinned.status_code == 207, pinned.text
    assert pinned.json()["pin_prefix"] is True  # stored: the kvchat replicas (none here) pinned it
    no_pin = {"replica": vllm.url, "outcome": "unsupported", "detail": "vLLM has no pinning"}
    assert pinned.json()["pinned_replicas"] == [no_pin]
    assert (pin_audit["result"], pin_audit["detail"]) == (
        "incomplete",
        f"pinned 0 blocks; not pinned on {vllm.url} (unsupported: vLLM has no pinning)",
    )
    assert edited.status_code == 207, edited.text
    assert (edited.json()["pinned_context"], edited.json()["complete"]) == ("VIP", False)
    assert [r["outcome"] for r in edited.json()["replicas"]] == ["unsupported"]
