"""``RemoteEngine`` against a replica that misbehaves: down, silent past the timeout, answering garbage, failing
before its first token (retried) or after it (an error, never a hang), busy, or serving another model.

The misbehaving replica is a raw socket server (``_Replica``): misbehaving is its point. It answers ``/kvchat/info``
with the tiny model's real info, so the client starts as against a real replica.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.engine_client.remote import RemoteEngine
from backend.engine_client.remote_errors import EngineMismatch, EngineProtocolError, EngineUnreachable
from backend.engine_client.values import EngineBusy, RequestFinished, SamplingParams, TokenDelta
from backend.engine_client.wire import encode
from engine.llm_engine import LLMEngine
from support.server import free_port

pytestmark = pytest.mark.anyio
PROMPT = [5, 6, 7, 8]


def _stream(token: int) -> bytes:
    delta = {"choices": [{"index": 0, "text": "x", "token_ids": [token], "finish_reason": None}]}
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    final = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}], "usage": usage}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (delta, final)) + b"data: [DONE]\n\n"


class _Replica:
    """An HTTP/1.1 server on loopback whose ``/v1/completions`` answers as ``modes`` says, one mode per request
    (the last one repeats): ok, garbage, silent, http500, busy, cut (one token, then the connection closes)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.modes = ["ok"]
        self.completions = 0
        self.last_body: dict[str, Any] = {}
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        self._handlers: set[asyncio.Task[Any]] = set()
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._ready.set()
        await self._stopping.wait()
        server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle(reader, writer)
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next((int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length")), 0)
        body = await reader.readexactly(length)
        if head.startswith("GET /kvchat/info"):
            await self._answer(writer, 200, "application/json", json.dumps(self.info).encode())
            return
        if not head.startswith("POST /v1/completions"):  # (e.g. /list_workers: a replica is no router)
            await self._answer(writer, 404, "application/json", b'{"error": {"code": "not_found"}}')
            return
        mode = self.modes[min(self.completions, len(self.modes) - 1)]
        self.completions += 1
        self.last_body = json.loads(body)
        if mode == "silent":
            await asyncio.sleep(3600)
        elif mode == "garbage":
            await self._answer(writer, 200, "text/html", b"<html>a captive portal</html>")
        elif mode == "http500":
            await self._answer(writer, 500, "text/plain", b"upstream exploded")
        elif mode == "busy":
            error = {"error": {"code": "busy", "message": "queue full; retry after 2.0s", "retry_after_s": 2.0}}
            await self._answer(writer, 503, "application/json", json.dumps(error).encode())
        elif mode == "cut":
            await self._answer(writer, 200, "text/event-stream", _stream(42).split(b"\n\n")[0] + b"\n\n", close=True)
        else:
            await self._answer(writer, 200, "text/event-stream", _stream(42))

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: int, kind: str, body: bytes, close: bool = False) -> None:
        # NOTE: "cut" announces more bytes than it sends, so the client sees the connection drop mid-body.
        size = len(body) + (1000 if close else 0)
        head = f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()


@pytest.fixture(scope="module")
def replica(tiny_engine: LLMEngine) -> Iterator[_Replica]:
    info = {"engine": "kvchat", "model": "kvchat/tiny", "info": encode(tiny_engine.info), "prompt_limit": 2048}
    fake = _Replica(info)
    yield fake
    fake.stop()


@pytest.fixture
async def remote(replica: _Replica, tiny_model_dir: Path) -> AsyncIterator[RemoteEngine]:
    replica.modes, replica.completions = ["ok"], 0
    engine = RemoteEngine(replica.url, model=str(tiny_model_dir), timeout_s=0.5, retries=2, backoff_s=0.01)
    await engine.start()
    yield engine
    await engine.stop()


async def _run(engine: RemoteEngine, events: list[Any] | None = None) -> list[Any]:
    events = [] if events is None else events
    async with asyncio.timeout(20):  # NOTE: a hang is the bug these tests look for; this bounds the test, not the code
        async for event in engine.generate(PROMPT, SamplingParams(max_tokens=1), "ns", session="s"):
            events.append(event)
    return events


async def test_a_good_replica_streams_its_tokens(remote: RemoteEngine) -> None:
    events = await _run(remote)
    assert isinstance(events[0], TokenDelta) and events[0].token_ids == (42,)
    assert isinstance(events[-1], RequestFinished) and events[-1].token_ids == (42,)


async def test_the_body_carries_what_the_engine_needs_of_the_prompt(remote: RemoteEngine, replica: _Replica) -> None:
    messages = [{"role": "system", "content": "Refunds are paid within 14 days."}, {"role": "user", "content": "Hi"}]
    tokenized = remote.tokenize_prompt(messages)
    async with asyncio.timeout(20):
        async for _ in remote.generate(messages, SamplingParams(max_tokens=1), "ns", session="s"):
            pass
    assert replica.last_body["prompt"] == tokenized.token_ids
    assert replica.last_body["kvchat"]["system_tokens"] == tokenized.system_tokens > 0  # (a release keeps them)


async def test_failures_before_the_first_token_are_retried(remote: RemoteEngine, replica: _Replica) -> None:
    replica.modes = ["http500", "garbage", "ok"]
    events = await _run(remote)
    assert isinstance(events[-1], RequestFinished)
    assert replica.completions == 3


@pytest.mark.parametrize(
    ("mode", "error", "words"),
    [
        ("silent", EngineUnreachable, "sent nothing for 0.5 s"),
        ("garbage", EngineProtocolError, "not an engine's"),
        ("http500", EngineUnreachable, "answered 500"),
    ],
)
async def test_a_replica_that_keeps_failing_is_a_clear_error(
    remote: RemoteEngine, replica: _Replica, mode: str, error: type[Exception], words: str
) -> None:
    replica.modes = [mode]
    with pytest.raises(error, match=words):
        await _run(remote)
    assert replica.completions == 3  # the first try and two retries


async def test_a_stream_cut_after_its_first_token_is_an_error_not_a_retry(
    remote: RemoteEngine, replica: _Replica
) -> None:
    replica.modes = ["cut", "ok"]
    seen: list[Any] = []
    with pytest.raises(EngineUnreachable, match=r"broke off the stream|closed the stream mid-reply"):
        await _run(remote, seen)
    assert [type(e) for e in seen] == [TokenDelta]
    assert replica.completions == 1


async def test_busy_is_the_engines_busy_at_once(remote: RemoteEngine, replica: _Replica) -> None:
    replica.modes = ["busy"]
    with pytest.raises(EngineBusy) as caught:
        await _run(remote)
    assert caught.value.retry_after_s == 2.0
    assert replica.completions == 1


async def test_a_replica_that_is_down(replica: _Replica, tiny_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine = RemoteEngine(dead, [replica.url], model=str(tiny_model_dir), timeout_s=0.5, retries=1, backoff_s=0.01)
    await engine.start()
    try:
        with pytest.raises(EngineUnreachable, match="cannot be reached"):
            await _run(engine)
    finally:
        await engine.stop()
    with pytest.raises(EngineUnreachable, match="cannot be reached"):
        await RemoteEngine(dead, model=str(tiny_model_dir), timeout_s=0.5).start()


async def test_a_replica_of_another_model_is_refused_at_start(replica: _Replica, tiny_model_dir: Path) -> None:
    original = replica.info
    replica.info = {**original, "info": {**original["info"], "fingerprint": "f" * 64}}
    try:
        with pytest.raises(EngineMismatch, match="serves another model"):
            await RemoteEngine(replica.url, model=str(tiny_model_dir)).start()
    finally:
        replica.info = original
