"""A misbehaving engine replica for the remote engine's tests: a raw HTTP/1.1 socket server on loopback (misbehaving
is its point) that answers ``/kvchat/info`` with a real model's info, so ``RemoteEngine`` starts as against a real
replica, and then answers completions (and control calls) as the test says."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from support.server import free_port


def sse_stream(token: int) -> bytes:
    delta = {"choices": [{"index": 0, "text": "x", "token_ids": [token], "finish_reason": None}]}
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    final = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}], "usage": usage}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (delta, final)) + b"data: [DONE]\n\n"


class FakeReplica:
    """An HTTP/1.1 server on loopback whose ``/v1/completions`` answers as ``modes`` says, one mode per request
    (the last one repeats): ok, garbage, silent, http500, busy, cut (one token, then the connection closes). Its other
    paths (the control calls) answer 404, or nothing at all while ``silent_control`` is set."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.modes = ["ok"]
        self.silent_control = False
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
        if self.silent_control and not head.startswith("POST /v1/completions"):
            await asyncio.sleep(3600)
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
            await self._answer(writer, 200, "text/event-stream", sse_stream(42).split(b"\n\n")[0] + b"\n\n", close=True)
        else:
            await self._answer(writer, 200, "text/event-stream", sse_stream(42))

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: int, kind: str, body: bytes, close: bool = False) -> None:
        # NOTE: "cut" announces more bytes than it sends, so the client sees the connection drop mid-body.
        size = len(body) + (1000 if close else 0)
        head = f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()
