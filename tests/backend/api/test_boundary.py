"""The body guard (``backend/api/boundary.py``) against a server's ``receive`` as uvicorn gives it: once the body has
ended, one more ``receive()`` waits for the client's disconnect. So the guard must answer its 413 without asking for
more once the body has ended, whichever message passes the cap: when the server lags, the message that passes the cap
is often the body's last (it then holds all that arrived meanwhile), and a guard that waited for more held the
request until the client gave up (``tests/backend/test_hostile_input.py``'s chunked /v1 413 timed out that way).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message, Receive, Scope, Send

from backend.api.boundary import BODY_CAP_KEY, BodyGuard

pytestmark = pytest.mark.anyio

CAP = 1000
MAX_BYTES = 10 * CAP
WAIT_S = 5.0  # a guard that answers does so at once; one that waits for more waits until the client disconnects


class Client:
    """Sends ``chunks`` as a chunked body (no Content-Length), then waits for the answer without disconnecting."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.sent: list[Message] = []
        self.reads = 0
        self._disconnect = asyncio.Event()  # (never set: the client waits for the 413 as an HTTP client does)

    async def receive(self) -> Message:
        self.reads += 1
        if self.reads <= len(self.chunks):
            more = self.reads < len(self.chunks)
            return {"type": "http.request", "body": self.chunks[self.reads - 1], "more_body": more}
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def status(self) -> int:
        return int(next(m["status"] for m in self.sent if m["type"] == "http.response.start"))

    def body(self) -> dict[str, object]:
        return dict(json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")))


async def _unreached(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("a body over the cap reached the app")


def _scope(path: str = "/v1/chat/completions", headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {"type": "http", "method": "POST", "path": path, "headers": headers or [], BODY_CAP_KEY: CAP}


async def _answer(client: Client, scope: Scope | None = None) -> None:
    async with asyncio.timeout(WAIT_S):
        await BodyGuard(_unreached, max_bytes=MAX_BYTES)(scope or _scope(), client.receive, client.send)


@pytest.mark.parametrize(
    "chunks",
    [[b"x" * (CAP + 1)], [b"x" * 600, b"x" * 600], [b"x" * 300, b"x" * 300, b"x" * 300, b"x" * 300]],
    ids=["one-message", "the-last-of-two", "the-last-of-four"],
)
async def test_a_body_whose_last_message_passes_the_cap_is_a_413_at_once(chunks: list[bytes]) -> None:
    client = Client(chunks)
    await _answer(client)
    assert client.status() == 413
    assert client.body()["error"] == {
        "message": f"the request body is larger than {CAP} bytes, more than any prompt the model accepts can take",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert client.reads == len(chunks)  # (nothing asked for past the body's end)


async def test_a_body_that_passes_the_cap_before_its_end_is_drained_then_a_413() -> None:
    client = Client([b"x" * 600, b"x" * 600, b"x" * 300, b"x" * 300])
    await _answer(client)
    assert client.status() == 413
    assert client.reads == 4  # the rest was read and dropped (within the drain bound), so the client reads the 413


async def test_a_body_past_the_global_cap_in_its_last_message_is_a_413_at_once() -> None:
    client = Client([b"x" * 600, b"x" * MAX_BYTES])
    scope = _scope("/admin/sessions/s/status")
    del scope[BODY_CAP_KEY]
    await _answer(client, scope)
    assert client.status() == 413
    assert client.body()["code"] == "request_too_large"
    assert client.reads == 2


async def test_a_content_length_over_the_cap_is_a_413_after_the_drain() -> None:
    client = Client([b"x" * 600, b"x" * 600])
    await _answer(client, _scope(headers=[(b"content-length", b"1200")]))
    assert client.status() == 413
    assert client.reads == 2
