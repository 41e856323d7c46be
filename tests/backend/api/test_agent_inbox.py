"""The inbox (issue 41) on a real server (Postgres, the tiny model): agents from the admin API, a customer's hand-off
reaches the queue, one claim at a time (409 naming the holder), an agent's reply reaches the customer's socket and is
stored with role ``agent``, bad replies store nothing, notes stay private, and a hand-back lets the bot answer again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from backend.db.models import Handoff, Message
from backend.domain import KeyKind
from backend.services import tenants
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT_S = 30.0
ADMIN = {"X-API-Key": ADMIN_KEY}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return frame


async def _until(ws: Any, kind: str) -> list[dict[str, Any]]:
    frames = [await _recv(ws)]
    while frames[-1]["type"] != kind:
        frames.append(await _recv(ws))
    return frames


async def _customer(live: LiveServer) -> tuple[Any, str]:
    ws = await websockets.connect(live.ws, max_queue=None)
    await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
    welcome = await _recv(ws)
    return ws, str(welcome["session_id"])


async def _send(ws: Any, msg_id: str, text: str) -> None:
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": text}))


async def _agent(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    created = await http.post("/admin/tenant/agents", headers=ADMIN, json={"name": name})
    assert created.status_code == 201, created.text
    body: dict[str, Any] = created.json()
    assert body["agent"]["name"] == name
    assert body["key"].startswith("kvc_agent_")
    return body


async def _count_agent_messages(live: LiveServer, session_id: str) -> int:
    async with db_session(live) as db:
        query = select(func.count()).where(Message.session_id == session_id, Message.role == "agent")
        return int(await db.scalar(query) or 0)


async def test_agent_keys_come_from_the_admin_api_and_open_no_admin_route(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        dana = await _agent(http, "Dana")
        again = await http.post("/admin/tenant/agents", headers=ADMIN, json={"name": "Dana"})
        assert again.status_code == 409
        assert again.json()["code"] == "agent_exists"
        refused = await http.get("/admin/tenant", headers=_auth(dana["key"]))
        assert refused.status_code == 401
        prompt = await http.put("/admin/tenant/system-prompt", headers=_auth(dana["key"]), json={"system_prompt": "x"})
        assert prompt.status_code == 401
        me = await http.get("/inbox/me", headers=_auth(dana["key"]))
        assert me.json() == {"name": "Dana", "agent_id": dana["agent"]["id"]}
        chat_key = await http.get("/inbox/me", headers=_auth(CHAT_TOKEN))
        assert chat_key.status_code == 401
        rotated = await http.post(f"/admin/tenant/agents/{dana['agent']['id']}/rotate", headers=ADMIN)
        assert rotated.status_code == 200
        assert (await http.get("/inbox/me", headers=_auth(dana["key"]))).status_code == 401  # the old key is revoked
        assert (await http.get("/inbox/me", headers=_auth(rotated.json()["key"]))).status_code == 200
        by_kind = await http.post("/admin/tenant/keys/rotate", headers=ADMIN, json={"kind": "agent"})
        assert by_kind.status_code == 422
        assert by_kind.json()["code"] == "agent_key_kind"
        listed = await http.get("/admin/tenant/agents", headers=ADMIN)
        assert [a["name"] for a in listed.json()] == ["Dana"]


async def test_a_hand_off_is_claimed_answered_and_handed_back_to_the_bot(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        dana, sam = await _agent(http, "Dana"), await _agent(http, "Sam")
        # NOTE: the whole history in every prompt, so the assertion below measures the agent's turn alone (under the
        # default policy a topic shift may legitimately drop the earlier epoch)
        settings = (await http.get("/admin/tenant/context-settings", headers=ADMIN)).json()
        settings["history_policy"] = "full"
        assert (await http.put("/admin/tenant/context-settings", headers=ADMIN, json=settings)).status_code == 200
        customer, session_id = await _customer(live)
        try:
            await _send(customer, "m1", "Where is my parcel?")
            first = (await _until(customer, "message.completed"))[-1]
            await _send(customer, "m2", "I want to talk to a real person")
            frames = await _until(customer, "session.queue")
            assert {"type": "session.status", "session_id": session_id, "status": "agent_requested"} in frames
            assert frames[-1] == {
                "type": "session.queue",
                "session_id": session_id,
                "position": 1,
                "expected_wait_s": None,
            }
            queue = (await http.get("/inbox", headers=_auth(dana["key"]))).json()
            assert [(e["session_id"], e["status"], e["reason"]) for e in queue] == [
                (session_id, "agent_requested", "customer_asked")
            ]
            assert queue[0]["last_customer_message"] == "I want to talk to a real person"
            assert queue[0]["topic_epoch"] >= 0

            # nobody holds it yet: a reply is refused and nothing is stored
            early = await http.post(f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": "Hi"})
            assert early.status_code == 409
            assert early.json()["code"] == "not_claimed"
            assert await _count_agent_messages(live, session_id) == 0

            claimed = await http.post(f"/inbox/{session_id}/claim", headers=_auth(dana["key"]))
            assert claimed.json() == {
                "session_id": session_id,
                "status": "agent_active",
                "reason": "customer_asked",
                "holder_name": "Dana",
            }
            joined = await _until(customer, "session.agent")
            expected = {"type": "session.agent", "session_id": session_id, "event": "joined", "agent_name": "Dana"}
            assert joined[-1] == expected
            second = await http.post(f"/inbox/{session_id}/claim", headers=_auth(sam["key"]))
            assert second.status_code == 409
            assert second.json() == {"detail": "this session is claimed by Dana", "code": "claimed_by_other"}
            by_sam = await http.post(f"/inbox/{session_id}/messages", headers=_auth(sam["key"]), json={"text": "Hi"})
            assert by_sam.status_code == 409
            assert by_sam.json()["code"] == "not_claimed"

            hostile = "<script>alert(1)</script> Dana here: your parcel left the depot."
            sent = await http.post(f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": hostile})
            assert sent.status_code == 201, sent.text
            assert sent.json()["role"] == "agent"
            assert sent.json()["agent_name"] == "Dana"
            got = (await _until(customer, "agent.message"))[-1]
            assert got["text"] == hostile  # as sent: the page renders it as text
            assert got["agent_name"] == "Dana"
            assert got["seq"] == sent.json()["seq"]

            # while a person holds the session, the bot sends nothing
            await _send(customer, "m3", "Thanks, when will it arrive?")
            held = await _until(customer, "session.status")
            assert [f["type"] for f in held] == ["message.ack", "session.status"]
            assert held[-1]["status"] == "agent_active"

            note = await http.post(
                f"/inbox/{session_id}/notes", headers=_auth(dana["key"]), json={"text": "VIP customer"}
            )
            assert note.status_code == 201
            notes = (await http.get(f"/inbox/{session_id}/notes", headers=_auth(sam["key"]))).json()
            assert [(n["author"], n["text"]) for n in notes] == [("Dana", "VIP customer")]

            back = await http.post(f"/inbox/{session_id}/hand-back", headers=_auth(dana["key"]))
            assert back.json()["status"] == "bot_active"
            left = (await _until(customer, "session.agent"))[-1]
            assert left["event"] == "handed_back"
            await _send(customer, "m4", "And can I change the address?")
            answered = (await _until(customer, "message.completed"))[-1]
        finally:
            await customer.close()
    assert answered["status"] == "complete"
    # the agent's turn is ordinary history: the bot's prompt extends the one it answered m1 with
    block = live.state.engine.info.block_size
    assert answered["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // block * block
    async with db_session(live) as db:
        handoff = (await db.execute(select(Handoff).where(Handoff.session_id == session_id))).scalar_one()
        roles = await db.execute(select(Message.role).where(Message.session_id == session_id).order_by(Message.seq))
        transcript = list(roles.scalars())
    assert (handoff.holder_name, handoff.outcome) == (None, "handed_back")
    assert handoff.first_claimed_at is not None and handoff.first_reply_at is not None
    assert transcript == ["user", "assistant", "user", "agent", "user", "user", "assistant"]
    # /metrics: one hand-off asked for by the customer, its wait for a claim and for a person's first reply
    async with httpx.AsyncClient(base_url=live.http) as http:
        metrics = (await http.get("/metrics")).text
        inbox = (await http.get("/admin/inbox", headers=ADMIN)).json()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
    }
    assert samples[("kvchat:handoffs_total", (("reason", "customer_asked"),))] == 1
    assert samples[("kvchat:inbox_queue_length_count", ())] == 1
    assert samples[("kvchat:handoff_wait_seconds_count", ())] == 1
    assert samples[("kvchat:handoff_first_reply_seconds_count", ())] == 1
    assert inbox["first_reply_p50_s"] is not None and inbox["first_reply_p50_s"] >= 0


async def test_replies_to_closed_or_other_tenants_sessions_are_refused_and_store_nothing(live: LiveServer) -> None:
    async with db_session(live) as db:
        other = await tenants.create_tenant(db, "tenant-b")
        other_admin = await tenants.issue_key(db, other.id, KeyKind.ADMIN)
        await db.commit()
    async with httpx.AsyncClient(base_url=live.http) as http:
        dana = await _agent(http, "Dana")
        customer, session_id = await _customer(live)
        try:
            await _send(customer, "m1", "I want to talk to a real person")
            await _until(customer, "session.queue")
        finally:
            await customer.close()
        foreign = await http.post(f"/inbox/{session_id}/claim", headers=_auth(other_admin.key))
        assert foreign.status_code == 404
        assert foreign.json()["code"] == "session_not_found"
        foreign_reply = await http.post(
            f"/inbox/{session_id}/messages", headers=_auth(other_admin.key), json={"text": "hi"}
        )
        assert foreign_reply.status_code == 404
        assert (await http.post(f"/inbox/{session_id}/claim", headers=_auth(dana["key"]))).status_code == 200
        closed = await http.post(f"/admin/sessions/{session_id}/status", headers=ADMIN, json={"status": "closed"})
        assert closed.status_code == 200, closed.text
        late = await http.post(f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": "hi"})
        assert late.status_code == 409
        assert late.json()["code"] == "session_closed"
        blank = await http.post(f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": "  "})
        assert blank.status_code == 422
        assert (await http.get("/inbox", headers=_auth(dana["key"]))).json() == []
    assert await _count_agent_messages(live, session_id) == 0


async def test_an_admins_status_change_opens_or_ends_the_hand_off(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        dana = await _agent(http, "Dana")
        customer, session_id = await _customer(live)
        await customer.close()
        status = f"/admin/sessions/{session_id}/status"
        asked = await http.post(status, headers=ADMIN, json={"status": "agent_active"})  # (a claim makes it active)
        assert asked.json()["status"] == "agent_requested"
        queue = (await http.get("/inbox", headers=_auth(dana["key"]))).json()
        assert [(e["session_id"], e["reason"]) for e in queue] == [(session_id, "admin")]
        assert (await http.post(f"/inbox/{session_id}/claim", headers=_auth(dana["key"]))).status_code == 200
        resolved = await http.post(status, headers=ADMIN, json={"status": "resolved"})
        assert resolved.json()["status"] == "resolved"
        assert (await http.get("/inbox", headers=_auth(dana["key"]))).json() == []
        late = await http.post(f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": "hi"})
        assert late.json()["code"] == "not_claimed"
        inbox = (await http.get("/admin/inbox", headers=ADMIN)).json()
    assert (inbox["waiting"], inbox["held"], inbox["handoffs_last_day"], inbox["queue"]) == (0, 0, 1, [])
    async with db_session(live) as db:
        handoff = (await db.execute(select(Handoff).where(Handoff.session_id == session_id))).scalar_one()
    assert (handoff.reason, handoff.outcome) == ("admin", "resolved")
