"""One chat websocket, as an explicit state machine: CONNECTING → (hello) → OPEN → CLOSED.

A reader task parses and dispatches frames; a writer task drains this socket's outgoing queue, so ``cancel`` is heard
while tokens stream out. No database connection is held between frames (each step opens a short session).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from fastapi import WebSocket
from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from backend.chat.protocol import (
    CLIENT_FRAME,
    Cancel,
    CloseCode,
    ErrorFrame,
    Hello,
    Ping,
    Pong,
    ServerFrame,
    UserMessage,
)
from backend.chat.rate_limit import TokenBucket
from backend.chat.service import ChatService
from backend.core.errors import BackendError, SessionNotFoundError
from backend.db.models import KeyKind, Tenant
from backend.services.tenants import authenticate
from engine.errors import EngineError

log = logging.getLogger("kvchat.ws")

_CLOSE = object()  # sentinel in the writer queue


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_message_bytes: int = 64 * 1024
    rate_per_s: float = 5.0
    burst: int = 10
    max_connections_per_tenant: int = 200
    hello_timeout_s: float = 10.0
    allowed_origins: tuple[str, ...] = ("*",)


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ChatConnection:
    def __init__(self, ws: WebSocket, service: ChatService, limits: ConnectionLimits) -> None:
        self.ws = ws
        self.service = service
        self.limits = limits
        self.outbox: asyncio.Queue[ServerFrame | object] = asyncio.Queue()
        self.bucket = TokenBucket(limits.rate_per_s, limits.burst)
        self.tenant: Tenant | None = None
        self.session_id: str | None = None

    def send(self, frame: ServerFrame) -> None:
        self.outbox.put_nowait(frame)

    async def serve(self) -> None:
        if not self._origin_allowed():
            await self.ws.accept()
            await self.ws.close(CloseCode.POLICY, "origin not allowed")
            return
        await self.ws.accept()
        writer = asyncio.create_task(self._write_loop(), name="ws-writer")
        token: int | None = None
        counted = False
        try:
            hello = await self._read_hello()
            self.tenant = await self._authenticate(hello)
            counted = self.service.hub.try_connect(self.tenant.id, self.limits.max_connections_per_tenant)
            if not counted:
                raise _Closed(CloseCode.TRY_AGAIN_LATER, "too many connections for this tenant")
            try:
                welcome = await self.service.open(self.tenant, hello)
            except SessionNotFoundError as exc:
                raise _Closed(CloseCode.SESSION_NOT_FOUND, str(exc)) from exc
            self.session_id = welcome.session_id
            token = self.service.hub.subscribe(welcome.session_id, self.send)
            self.send(welcome)
            await self._read_loop()
        except _Closed as closed:
            await self._drain_and_close(writer, closed.code, closed.reason)
        except WebSocketDisconnect:
            pass
        finally:
            if token is not None and self.session_id is not None:
                self.service.hub.unsubscribe(self.session_id, token)
            if counted and self.tenant is not None:
                self.service.hub.disconnect(self.tenant.id)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    # ---------------------------------------------------------------- reading

    async def _receive_text(self) -> str:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data = message.get("text")
        if data is None:
            raw = message.get("bytes") or b""
            if len(raw) > self.limits.max_message_bytes:
                raise _Closed(CloseCode.TOO_BIG, "message too big")
            self.send(ErrorFrame(code="invalid_frame", message="binary frames are not supported; send JSON text"))
            return ""
        if len(data.encode()) > self.limits.max_message_bytes:
            raise _Closed(CloseCode.TOO_BIG, f"message too big (limit {self.limits.max_message_bytes} bytes)")
        return str(data)

    async def _read_hello(self) -> Hello:
        try:
            data = await asyncio.wait_for(self._receive_text(), self.limits.hello_timeout_s)
        except TimeoutError as exc:
            raise _Closed(CloseCode.UNAUTHORIZED, "no hello received") from exc
        frame = self._parse(data)
        if not isinstance(frame, Hello):
            raise _Closed(CloseCode.UNAUTHORIZED, "the first frame must be hello")
        return frame

    async def _authenticate(self, hello: Hello) -> Tenant:
        async with self.service.sessionmaker() as db:
            tenant = await authenticate(db, hello.token, KeyKind.CHAT)
        if tenant is None:
            raise _Closed(CloseCode.UNAUTHORIZED, "invalid token")
        return tenant

    def _parse(self, data: str) -> Hello | UserMessage | Cancel | Ping | None:
        if not data:
            return None
        try:
            raw = json.loads(data)
        except json.JSONDecodeError as exc:
            self.send(ErrorFrame(code="bad_json", message=f"frame is not valid JSON: {exc.msg}"))
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            self.send(ErrorFrame(code="invalid_frame", message="a frame must be a JSON object with a string 'type'"))
            return None
        try:
            return CLIENT_FRAME.validate_python(raw)
        except ValidationError as exc:
            code = "unknown_type" if raw["type"] not in _KNOWN else "invalid_frame"
            detail = exc.errors()[0]
            loc = ".".join(str(p) for p in detail["loc"][1:]) or raw["type"]
            self.send(ErrorFrame(code=code, message=f"{loc}: {detail['msg']}"))
            return None

    async def _read_loop(self) -> None:
        while True:
            data = await self._receive_text()
            # NOTE: every frame counts, malformed ones too: otherwise a client could flood us with error replies.
            wait = self.bucket.take()
            if wait > 0:
                self.send(
                    ErrorFrame(code="rate_limited", message="too many frames", retry_after_ms=int(wait * 1000) + 1)
                )
                continue
            frame = self._parse(data)
            if frame is not None:
                await self._dispatch(frame)

    async def _dispatch(self, frame: Hello | UserMessage | Cancel | Ping) -> None:
        assert self.tenant is not None and self.session_id is not None
        if isinstance(frame, Ping):
            self.send(Pong(nonce=frame.nonce))
        elif isinstance(frame, Hello):
            self.send(ErrorFrame(code="invalid_frame", message="already authenticated; hello is only the first frame"))
        elif isinstance(frame, Cancel):
            if not self.service.cancel(self.session_id, frame.client_msg_id):
                self.send(
                    ErrorFrame(
                        code="nothing_to_cancel", message="no reply in flight", client_msg_id=frame.client_msg_id
                    )
                )
        else:
            try:
                await self.service.submit(self.tenant, self.session_id, frame, self.send)
            except (BackendError, EngineError) as exc:
                code = getattr(exc, "code", "error")
                self.send(ErrorFrame(code=code, message=str(exc), client_msg_id=frame.client_msg_id))

    # ---------------------------------------------------------------- writing / closing

    async def _write_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            if frame is _CLOSE:
                return
            if isinstance(frame, BaseModel):
                await self.ws.send_text(frame.model_dump_json())

    async def _drain_and_close(self, writer: asyncio.Task[None], code: int, reason: str) -> None:
        self.outbox.put_nowait(_CLOSE)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, 2.0)
        if self.ws.client_state != WebSocketState.DISCONNECTED:
            with contextlib.suppress(RuntimeError):
                await self.ws.close(code, reason[:120])

    def _origin_allowed(self) -> bool:
        allowed = self.limits.allowed_origins
        if "*" in allowed:
            return True
        origin = self.ws.headers.get("origin")
        return origin is None or origin in allowed


_KNOWN = {"hello", "user.message", "cancel", "ping"}
