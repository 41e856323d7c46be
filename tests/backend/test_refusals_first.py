"""Refusals first (issue 42): a socket over a cap is refused without waiting for the welcomes in flight, and a ``/v1``
body too large for any prompt the model accepts is refused from its ``Content-Length``.

The welcomes run ``MAX_WELCOMING`` at a time (``backend/chat/hub.py``) so that a burst's database work cannot hold up
the event loop; the refusals go around that bound. Here every welcoming slot is taken, a hello under the cap waits,
and one over the cap is still refused at once. How fast a refusal is under a flood is ``bench/refusals.py``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from engine.llm_engine import LLMEngine
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT_S = 30.0
TENANT_CAP = 2
TRY_AGAIN_LATER = 1013


@pytest.fixture
def live(sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(
        sqlite_url,
        tmp_path,
        max_connections_per_tenant=TENANT_CAP,
        max_request_bytes=64 * 1024 * 1024,  # (above the /v1 bound, so that the bound is what refuses)
    )
    with serving(settings, tiny_engine) as server:
        yield server


def _hello(ref: str) -> str:
    return json.dumps({"type": "hello", "token": CHAT_TOKEN, "external_ref": ref})


async def test_a_socket_over_the_cap_is_refused_while_the_welcomes_wait_for_a_slot(live: LiveServer) -> None:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT_S) as first:
        await first.send(_hello("first"))  # (the key is known from here on: the refusals come from memory)
        assert json.loads(await asyncio.wait_for(first.recv(), TIMEOUT_S))["type"] == "welcome"
        hub = live.state.chat.hub
        hub.welcoming = asyncio.Semaphore(0)  # every slot taken
        async with websockets.connect(live.ws, open_timeout=TIMEOUT_S) as waiting:
            await waiting.send(_hello("waiting"))  # under the cap: counted, then waits for a slot
            async with websockets.connect(live.ws, open_timeout=TIMEOUT_S) as over:
                await over.send(_hello("over"))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(over.recv(), TIMEOUT_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == TRY_AGAIN_LATER
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(waiting.recv(), 0.2)  # (still waiting for its slot)
            hub.welcoming._loop.call_soon_threadsafe(hub.welcoming.release)  # (a slot, on the server's loop)
            assert json.loads(await asyncio.wait_for(waiting.recv(), TIMEOUT_S))["type"] == "welcome"


def _completion(content_bytes: int) -> bytes:
    head, tail = b'{"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "', b'"}]}'
    return head + b"a" * (content_bytes - len(head) - len(tail)) + tail


async def test_a_v1_body_larger_than_any_usable_request_is_refused_as_too_large(live: LiveServer) -> None:
    bound = live.state.admission.max_body_bytes
    assert bound is not None and bound < live.settings.max_request_bytes
    headers = {"Authorization": f"Bearer {CHAT_TOKEN}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT_S, headers=headers) as client:
        over = await client.post("/v1/chat/completions", content=_completion(bound + 1))
        under = await client.post("/v1/chat/completions", content=_completion(bound))
    assert over.status_code == 413, over.text
    assert over.json()["error"]["code"] == "request_too_large"
    assert "more than any prompt the model accepts" in over.json()["error"]["message"]
    assert under.status_code == 400, under.text  # read, parsed, and refused for its length by the prompt guard
    assert under.json()["error"]["code"] == "context_length_exceeded"
    assert live.state.admission.admitted == 0  # (neither is still counted as in flight)
