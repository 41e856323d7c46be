"""One agent's live feed (``/ws/agent``): the tenant's inbox as it changes, over one websocket per agent.

CONNECTING → (``hello`` with an agent or admin key) → OPEN → CLOSED. On open: ``agent.welcome`` with the inbox as it
stands, then every frame published on the tenant's inbox channel, from any worker (the fan-out carries them): new
hand-offs, claims and their ends, customer messages and typing in the inbox's sessions, agents' replies. The agent
sends ``typing`` (shown to the customer of that session) and ``ping``.

The socket is watched under its key: revoking or rotating that key closes it with 4401 "key revoked" (within a second
on every worker, ``backend/services/revocation.py``). A client that stops reading is closed (1008) rather than
buffered without bound. No database connection is held between frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import WebSocket
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.websockets import WebSocketDisconnect, WebSocketState

from backend.chat.agent_desk import AgentDesk, entry_frame
from backend.chat.agent_protocol import (
    AGENT_CLIENT_FRAME,
    AgentHello,
    AgentPing,
    AgentTyping,
    AgentWelcome,
    inbox_channel,
)
from backend.chat.hub import SessionHub
from backend.chat.protocol import CloseCode, ErrorFrame, Pong, ServerFrame, describe_validation_error
from backend.chat.rate_limit import TokenBucket
from backend.core.limits import json_too_deep
from backend.services.agents import Actor, authenticate_actor

log = logging.getLogger("kvchat.agent_feed")

HELLO_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 16 * 1024
RATE_PER_S, RATE_BURST = 5.0, 10  # frames from the agent (typing is sent at most every 2 s by /agent)
MAX_QUEUED = 4096  # frames waiting for a slow agent's socket; past it the socket is closed
_CLOSE_WAIT_S = 2.0


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class AgentFeed:
    def __init__(
        self, ws: WebSocket, sessionmaker: async_sessionmaker[AsyncSession], hub: SessionHub, desk: AgentDesk
    ) -> None:
        self.ws = ws
        self._sm = sessionmaker
        self._hub = hub
        self._desk = desk
        self._outbox: asyncio.Queue[str | None] = asyncio.Queue(maxsize=MAX_QUEUED)
        self._revoked = asyncio.Event()
        self._too_slow = asyncio.Event()
        self._bucket = TokenBucket(RATE_PER_S, RATE_BURST)

    def send(self, frame: ServerFrame | AgentWelcome) -> None:
        try:
            self._outbox.put_nowait(frame.model_dump_json())
        except asyncio.QueueFull:
            self._too_slow.set()

    async def serve(self) -> None:
        await self.ws.accept()
        writer = asyncio.create_task(self._write_loop(), name="agent-feed-writer")
        actor: Actor | None = None
        token = watching = None
        try:
            actor = await self._authenticate()
            watching = self._hub.keys.watch(actor.key_id, self._revoked.set)
            channel = inbox_channel(actor.tenant.id)
            # NOTE: subscribed before the inbox is read: a change in between is both in the welcome and a frame after
            # it (a client applies frames by session id, so seeing one twice is harmless; missing one is not)
            token = self._hub.subscribe(channel, self.send)
            queue = await self._desk.queue(actor)
            self._outbox.put_nowait(
                AgentWelcome(agent_name=actor.name, queue=[entry_frame(e) for e in queue]).model_dump_json()
            )
            await self._until_closed(actor)
        except _Closed as closed:
            await self._close(writer, closed.code, closed.reason)
        except WebSocketDisconnect:
            pass
        except Exception:
            log.exception("agent feed failed")
            await self._close(writer, CloseCode.INTERNAL, "internal error")
        finally:
            if token is not None and actor is not None:
                self._hub.unsubscribe(inbox_channel(actor.tenant.id), token)
            if watching is not None and actor is not None:
                self._hub.keys.unwatch(actor.key_id, watching)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    async def _authenticate(self) -> Actor:
        try:
            text = await asyncio.wait_for(self._receive(), HELLO_TIMEOUT_S)
        except TimeoutError as exc:
            raise _Closed(CloseCode.UNAUTHORIZED, "no hello received") from exc
        frame = self._parse(text)
        if not isinstance(frame, AgentHello):
            raise _Closed(CloseCode.UNAUTHORIZED, "the first frame must be hello")
        async with self._sm() as db:
            actor = await authenticate_actor(db, frame.token)
        if actor is None:
            raise _Closed(CloseCode.UNAUTHORIZED, "invalid key")
        return actor

    async def _until_closed(self, actor: Actor) -> None:
        reader = asyncio.create_task(self._read_loop(actor), name="agent-feed-reader")
        revoked = asyncio.create_task(self._revoked.wait())
        slow = asyncio.create_task(self._too_slow.wait())
        try:
            await asyncio.wait({reader, revoked, slow}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, revoked, slow):
                task.cancel()
        if reader.done() and not reader.cancelled():
            reader.result()
        if self._revoked.is_set():
            raise _Closed(CloseCode.UNAUTHORIZED, "key revoked")
        raise _Closed(CloseCode.POLICY, "the client is not reading its frames")

    async def _read_loop(self, actor: Actor) -> None:
        while True:
            text = await self._receive()
            wait = self._bucket.take()  # NOTE: every frame counts (a typing frame costs a database read)
            if wait > 0:
                self.send(
                    ErrorFrame(code="rate_limited", message="too many frames", retry_after_ms=int(wait * 1000) + 1)
                )
                continue
            frame = self._parse(text)
            if isinstance(frame, AgentTyping):
                await self._desk.typing(actor, frame.session_id)
            elif isinstance(frame, AgentHello):
                self.send(ErrorFrame(code="invalid_frame", message="already authenticated"))
            elif frame is not None:
                self.send(Pong(nonce=frame.nonce))

    async def _receive(self) -> str:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        text = message.get("text")
        if text is None or len(text.encode()) > MAX_FRAME_BYTES:
            raise _Closed(CloseCode.TOO_BIG if text else CloseCode.POLICY, "send JSON text frames under 16 KiB")
        return str(text)

    def _parse(self, text: str) -> AgentHello | AgentTyping | AgentPing | None:
        """The frame, or None after answering a bad one with an ``error`` frame."""
        if json_too_deep(text):
            self.send(ErrorFrame(code="bad_json", message="frame is nested too deeply"))
            return None
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError):
            self.send(ErrorFrame(code="bad_json", message="frame is not valid JSON"))
            return None
        try:
            return AGENT_CLIENT_FRAME.validate_python(raw)
        except ValidationError as exc:
            self.send(ErrorFrame(code="invalid_frame", message=describe_validation_error(exc, "agent frame")))
            return None

    async def _write_loop(self) -> None:
        while True:
            text = await self._outbox.get()
            if text is None:
                return
            await self.ws.send_text(text)

    async def _close(self, writer: asyncio.Task[None], code: int, reason: str) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._outbox.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, _CLOSE_WAIT_S)
        if self.ws.client_state != WebSocketState.DISCONNECTED:
            with contextlib.suppress(RuntimeError, TimeoutError, OSError):
                await asyncio.wait_for(self.ws.close(code, reason), _CLOSE_WAIT_S)
