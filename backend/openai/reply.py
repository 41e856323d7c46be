"""One ``/v1`` request's reply: the engine's event stream (``EngineClient.generate``), read with timeouts.

A reader that waits with a timeout (the SSE keep-alive, the disconnect poll of a non-streaming request) must not
cancel the stream's pending read when the time is up: cancelling the stream aborts the request. So the pending read
is a task that outlives a wait, picked up by the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from backend.core.metrics import ReplyTimer
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import GenerationEvent, RequestFinished, TokenDelta


class Reply:
    """The events of request ``request_id`` (``TokenDelta``s, then one ``RequestFinished``)."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        events: AsyncGenerator[GenerationEvent, None],
        timer: ReplyTimer | None = None,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._events = events
        self._timer = timer
        self._read: asyncio.Task[GenerationEvent] | None = None
        self.finished: RequestFinished | None = None
        self._closed = False

    async def next(self, timeout_s: float | None = None) -> GenerationEvent | None:
        """The next event, or None after ``timeout_s`` of silence (the read goes on). Raises the request's
        ``EngineError``; the first read raises what refused the request (busy, too long)."""
        if self._read is None:
            self._read = asyncio.create_task(self._next_event())
        done, _ = await asyncio.wait({self._read}, timeout=timeout_s)
        if not done:
            return None
        read, self._read = self._read, None
        event = read.result()
        if isinstance(event, RequestFinished):
            self.finished = event
        if self._timer is not None and isinstance(event, TokenDelta):
            self._timer.delta()
        elif self._timer is not None and isinstance(event, RequestFinished):
            self._timer.finished(event.stats)
        return event

    async def _next_event(self) -> GenerationEvent:
        return await anext(self._events)

    async def close(self) -> None:
        """Free the request's blocks unless it finished, and end the stream (idempotent: safe from any ``finally``).

        NOTE: ``abort`` first, which needs no await: the stream ends however this coroutine is interrupted.
        """
        if self._closed:
            return
        self._closed = True
        if self.finished is None:
            self._engine.abort(self.request_id)
        read, self._read = self._read, None
        if read is not None:
            read.cancel()
            await asyncio.wait({read})
            if not read.cancelled():
                read.exception()  # (retrieved: an error it raised meanwhile is the request's end, not news)
        await self._events.aclose()
