"""Reading the ``n`` engine requests of one ``/v1`` request as one stream, and sending it as server-sent events.

``merged`` yields each choice's events as they come (in no fixed order across choices, in order within one), or
None after a silence (the caller sends a keep-alive or checks its client). ``EventStreamResponse`` frees the engine
requests however the response ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from backend.engine_client.values import GenerationEvent, RequestFinished
from backend.openai import schemas as s
from backend.openai.reply import Reply


async def merged(
    replies: Sequence[Reply], firsts: Sequence[GenerationEvent], timeout_s: float
) -> AsyncGenerator[tuple[int, GenerationEvent] | None, None]:
    """The events of ``replies`` (their first ones already read: ``firsts``) until each has finished; raises the
    first ``EngineError`` any of them raises. Closing it leaves the replies to their owner's ``close``."""
    for i, first in enumerate(firsts):
        yield i, first
    reads: dict[asyncio.Task[GenerationEvent | None], int] = {}
    try:
        for i, first in enumerate(firsts):
            if not isinstance(first, RequestFinished):
                reads[asyncio.create_task(replies[i].next())] = i
        while reads:
            done, _ = await asyncio.wait(reads, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield None
            for task in sorted(done, key=reads.__getitem__):
                i = reads.pop(task)
                event = task.result()
                assert event is not None  # NOTE: a read without a timeout always returns an event
                if not isinstance(event, RequestFinished):
                    reads[asyncio.create_task(replies[i].next())] = i
                yield i, event
    finally:
        # NOTE: cancelling a ``Reply.next`` leaves its pending read to ``Reply.close``, which ends the request.
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that calls ``on_close`` however the response ends (done, error, client gone).

    NOTE: an ASGI 2.4 server reports a disconnect as an ``OSError`` from ``send``, after which Starlette leaves the body
    iterator unclosed until garbage collection; ``on_close`` frees the engine requests at once either way.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def sse(payload: s.ChatCompletionChunk | s.ErrorResponse) -> str:
    """One ``data:`` event."""
    data: dict[str, Any] = payload.model_dump(exclude_none=isinstance(payload, s.ChatCompletionChunk))
    if isinstance(payload, s.ChatCompletionChunk):
        # NOTE: OpenAI sends ``"finish_reason": null`` and ``"logprobs": null`` on every chunk; keep those keys.
        for choice in data["choices"]:
            choice.setdefault("finish_reason", None)
            choice.setdefault("logprobs", None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
