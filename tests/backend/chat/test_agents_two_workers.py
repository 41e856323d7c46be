"""Issue 41's acceptance on two real ``kvchat serve`` workers on one Postgres database: a customer asks for a person
on worker A; the agent's feed on worker B shows the session within 1 s; the agent claims it and replies through B;
the customer's socket on A gets the reply; a reconnect to B replays it; a second agent's claim is a 409 naming the
holder; after the hand-back the bot's next prompt holds the agent's turn and extends the cached prefix. Revoking the
agent's key closes their feed within 1 s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from support.server import ADMIN_KEY, CHAT_TOKEN
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT_S = 60.0
BLOCK = 16  # the engine's default KV block size (engine/config.py)
ADMIN = {"X-API-Key": ADMIN_KEY}
AGENT_TEXT = "Hello, this is Dana from the shipping team. Your parcel left our depot this morning."


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _recv(ws: Any, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    return frame


async def _until(ws: Any, kind: str, timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    frames = [await _recv(ws, timeout_s)]
    while frames[-1]["type"] != kind:
        frames.append(await _recv(ws, timeout_s))
    return frames


async def _hello(ws: Any, session_id: str | None = None, last_seq: int = 0) -> dict[str, Any]:
    hello: dict[str, Any] = {"type": "hello", "token": CHAT_TOKEN, "last_seq": last_seq}
    if session_id is not None:
        hello["session_id"] = session_id
    await ws.send(json.dumps(hello))
    welcome = await _recv(ws)
    assert welcome["type"] == "welcome", welcome
    return welcome


async def _send(ws: Any, msg_id: str, text: str) -> None:
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": text}))


@pytest.fixture(scope="module")
def workers(
    pg_module_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    tmp_path = tmp_path_factory.mktemp("agent-workers")
    started: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            data = tmp_path / name
            data.mkdir()
            env = tiny_server_env(
                pg_module_url, tiny_model_dir, data, reply_max_tokens=8, run_migrations_on_start="false"
            )
            started.append(start_server_process(env, tmp_path / f"serve-{name}.log"))
        yield started
    finally:
        for server in started:
            server.kill()


async def _setup(http: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Any]]:
    # NOTE: the whole history in every prompt, so the cache assertion measures the agent's turn alone (under the
    # default policy a topic shift may legitimately drop the earlier epoch)
    settings = (await http.get("/admin/tenant/context-settings", headers=ADMIN)).json()
    settings["history_policy"] = "full"
    assert (await http.put("/admin/tenant/context-settings", headers=ADMIN, json=settings)).status_code == 200
    made = []
    for name in ("Dana", "Sam"):
        created = await http.post("/admin/tenant/agents", headers=ADMIN, json={"name": name})
        assert created.status_code == 201, created.text
        made.append(created.json())
    return made[0], made[1]


async def test_a_hand_off_crosses_workers_and_the_bot_takes_over_with_the_agents_turn(
    workers: list[ServerProcess],
) -> None:
    a, b = workers
    async with httpx.AsyncClient(base_url=a.http) as on_a, httpx.AsyncClient(base_url=b.http) as on_b:
        dana, sam = await _setup(on_a)
        async with websockets.connect(b.ws.replace("/ws/chat", "/ws/agent")) as feed:
            await feed.send(json.dumps({"type": "hello", "token": dana["key"]}))
            welcome = await _recv(feed)
            assert (welcome["type"], welcome["agent_name"], welcome["queue"]) == ("agent.welcome", "Dana", [])
            async with websockets.connect(a.ws, max_queue=None) as customer:
                session_id = (await _hello(customer))["session_id"]
                await _send(customer, "m1", "Where is my parcel?")
                first = (await _until(customer, "message.completed"))[-1]
                asked_at = time.monotonic()
                await _send(customer, "m2", "I want to talk to a real person")
                ack = (await _until(customer, "message.ack"))[-1]
                handoff = (await _until(feed, "inbox.handoff", timeout_s=1.0))[-1]
                assert time.monotonic() - asked_at < 1.0
                assert handoff["entry"]["session_id"] == session_id
                assert handoff["entry"]["last_customer_message"] == "I want to talk to a real person"

                claimed = await on_b.post(f"/inbox/{session_id}/claim", headers=_auth(dana["key"]))
                assert claimed.status_code == 200, claimed.text
                second = await on_a.post(f"/inbox/{session_id}/claim", headers=_auth(sam["key"]))
                assert second.status_code == 409
                assert second.json() == {"detail": "this session is claimed by Dana", "code": "claimed_by_other"}
                joined = (await _until(customer, "session.agent"))[-1]
                assert (joined["event"], joined["agent_name"]) == ("joined", "Dana")

                reply = await on_b.post(
                    f"/inbox/{session_id}/messages", headers=_auth(dana["key"]), json={"text": AGENT_TEXT}
                )
                assert reply.status_code == 201, reply.text
                got = (await _until(customer, "agent.message"))[-1]
                assert (got["seq"], got["agent_name"], got["text"]) == (reply.json()["seq"], "Dana", AGENT_TEXT)
            # the customer comes back on the other worker: the agent's reply is replayed
            async with websockets.connect(b.ws, max_queue=None) as customer:
                resumed = await _hello(customer, session_id, last_seq=ack["seq"])
                assert [(m["role"], m["agent_name"], m["content"]) for m in resumed["messages"]] == [
                    ("agent", "Dana", AGENT_TEXT)
                ]
                assert resumed["status"] == "agent_active"
            # NOTE: back on worker A for the bot's turn: each test worker runs its own engine (and KV cache), and the
            # bot's first reply was computed on A's
            async with websockets.connect(a.ws, max_queue=None) as customer:
                await _hello(customer, session_id, last_seq=reply.json()["seq"])
                back = await on_b.post(f"/inbox/{session_id}/hand-back", headers=_auth(dana["key"]))
                assert back.json()["status"] == "bot_active"
                assert (await _until(customer, "session.agent"))[-1]["event"] == "handed_back"
                await _send(customer, "m3", "Thanks. Can I change the delivery address?")
                answered = (await _until(customer, "message.completed"))[-1]
            changed = [f for f in await _until(feed, "inbox.changed") if f["type"] == "inbox.changed"]
            assert changed[-1]["session_id"] == session_id
    assert answered["status"] == "complete"
    usage = answered["usage"]
    # the agent's turn is in the prompt (it grew by more than the two customer messages could) ...
    assert usage["prompt_tokens"] > first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] + 20
    # ... and the prompt extends the one the bot answered m1 with: that one is served from the cache
    assert usage["cached_tokens"] >= first["usage"]["prompt_tokens"] // BLOCK * BLOCK


async def test_revoking_an_agents_key_closes_their_feed_within_a_second(workers: list[ServerProcess]) -> None:
    a, b = workers
    async with httpx.AsyncClient(base_url=a.http) as on_a:
        created = await on_a.post("/admin/tenant/agents", headers=ADMIN, json={"name": "Robin"})
        agent = created.json()
        async with websockets.connect(b.ws.replace("/ws/chat", "/ws/agent")) as feed:
            await feed.send(json.dumps({"type": "hello", "token": agent["key"]}))
            assert (await _recv(feed))["type"] == "agent.welcome"
            revoked_at = time.monotonic()
            revoked = await on_a.post(f"/admin/tenant/keys/{agent['key_id']}/revoke", headers=ADMIN)
            assert revoked.status_code == 200
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await _until(feed, "never sent", timeout_s=2.0)
            assert time.monotonic() - revoked_at < 1.0
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4401, "key revoked")
