"""One chat websocket, as an explicit state machine: CONNECTING → (hello) → OPEN → CLOSED.

A reader task parses and dispatches frames; a writer task drains this socket's outgoing queue, so ``cancel`` is heard
while tokens stream out. No database connection is held between frames (each step opens a short session). The socket
is watched under the key it authenticated with: revoking or rotating that key closes it (4401 "key revoked").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import WebSocket
from sqlalchemy.exc import SQLAlchemyError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from backend.chat.hub import ConnectionKey
from backend.chat.protocol import (
    AnyClientFrame,
    Cancel,
    CloseCode,
    ErrorFrame,
    Hello,
    Ping,
    Pong,
    ServerFrame,
    Typing,
    parse_client_frame,
)
from backend.chat.rate_limit import TokenBucket
from backend.chat.service import ChatService
from backend.core import client_errors, logs
from backend.core.errors import BackendError, SessionNotFoundError
from backend.core.metrics import Metrics
from backend.db.models import Tenant
from backend.domain import KeyKind
from backend.engine_client.values import EngineError
from backend.services.tenants import KeyOwner

log = logging.getLogger("kvchat.ws")
refusals = client_errors.RateLimitedLog(log)  # one line per kind of refused socket, at most every 10 s
client_errors.install()  # uvicorn's line for a client's bad frame: one line, no traceback

_CLOSE = object()  # sentinel in the writer queue


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_message_bytes: int = 64 * 1024
    rate_per_s: float = 5.0
    burst: int = 10
    max_connections_per_tenant: int = 200
    max_connections_per_client: int = 20
    max_queued_frames: int = 1024
    max_queued_bytes: int = 4 * 1024 * 1024
    hello_timeout_s: float = 10.0
    allowed_origins: tuple[str, ...] = ("*",)


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ChatConnection:
    def __init__(
        self,
        ws: WebSocket,
        service: ChatService,
        limits: ConnectionLimits,
        metrics: Metrics,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.ws = ws
        self.on_closed = on_closed  # told once the socket is gone (the server then hands back what it held)
        self.service = service
        self.limits = limits
        self.metrics = metrics
        # NOTE: bounded: a client that stops reading fills it, and is then closed instead of growing our memory.
        self.outbox: asyncio.Queue[str | object] = asyncio.Queue(maxsize=limits.max_queued_frames)
        self.queued_bytes = 0
        self.too_slow = asyncio.Event()
        self.key_revoked = asyncio.Event()
        self.bucket = TokenBucket(limits.rate_per_s, limits.burst)
        self.tenant: Tenant | None = None
        self.session_id: str | None = None

    def send(self, frame: ServerFrame) -> None:
        """Queue a frame for this socket (serialized now, so the queue's bytes are known)."""
        if isinstance(frame, ErrorFrame):
            self.metrics.errors.labels(frame.code).inc()
        if self.too_slow.is_set():
            return
        text = frame.model_dump_json()
        if self.queued_bytes + len(text) > self.limits.max_queued_bytes:
            self.too_slow.set()
            return
        try:
            self.outbox.put_nowait(text)
        except asyncio.QueueFull:
            self.too_slow.set()
            return
        self.queued_bytes += len(text)

    async def serve(self) -> None:
        if not self._origin_allowed():
            await self.ws.accept()
            await self.ws.close(CloseCode.POLICY, "origin not allowed")
            return
        await self.ws.accept()
        self.metrics.open_sockets.inc()
        writer = asyncio.create_task(self._write_loop(), name="ws-writer")
        token: int | None = None
        client: ConnectionKey | None = None
        owner: KeyOwner | None = None
        watching = 0
        try:
            hello = await self._read_hello()
            client = self._reserve_early(hello)
            async with self.service.hub.welcoming:  # (a few at a time: the refusals are not queued behind them)
                owner = await self._authenticate(hello)
                watching = self.service.hub.keys.watch(owner.key_id, self.key_revoked.set)
                self.tenant = owner.tenant
                if client is None or client.tenant_id != owner.tenant.id:  # (not known, or the key changed hands)
                    if client is not None:
                        self.service.hub.disconnect(client)
                        client = None
                    client = self._connect(ConnectionKey(owner.tenant.id, self._client_ref(hello)))
                # NOTE: a resumed session is heard from the other workers before its welcome is read (fan-out)
                async with self.service.hub.following(hello.session_id or ""):
                    try:
                        welcome = await self.service.open(self.tenant, hello)
                    except SessionNotFoundError as exc:
                        raise _Closed(CloseCode.SESSION_NOT_FOUND, str(exc)) from exc
                    self.session_id = welcome.session_id
                    logs.session_id.set(welcome.session_id)  # this socket's log lines, and its turns', carry it
                    token = self.service.hub.subscribe(welcome.session_id, self.send)
                    self.send(welcome)
            await self._read_until_closed()
        except _Closed as closed:
            if closed.code == CloseCode.TRY_AGAIN_LATER:
                refusals.info(closed.reason, f"refused a socket with 1013: {closed.reason}")
            await self._drain_and_close(writer, closed.code, closed.reason)
        except WebSocketDisconnect:
            pass
        except Exception:
            # NOTE: a bug must cost this socket a clean 1011, never a 1006 drop without a close frame.
            log.exception("chat socket failed")
            await self._drain_and_close(writer, CloseCode.INTERNAL, "internal error")
        finally:
            if token is not None and self.session_id is not None:
                self.service.hub.unsubscribe(self.session_id, token)
            if owner is not None:
                self.service.hub.keys.unwatch(owner.key_id, watching)
            if client is not None:
                self.service.hub.disconnect(client)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            self.metrics.open_sockets.dec()
            if self.on_closed is not None:
                self.on_closed()

    async def _read_until_closed(self) -> None:
        """Read frames until the client leaves, until its key is revoked, or until it has stopped reading ours for too
        long."""
        reader = asyncio.create_task(self._read_loop(), name="ws-reader")
        slow = asyncio.create_task(self.too_slow.wait(), name="ws-too-slow")
        revoked = asyncio.create_task(self.key_revoked.wait(), name="ws-key-revoked")
        try:
            await asyncio.wait({reader, slow, revoked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, slow, revoked):
                task.cancel()
        if reader.done() and not reader.cancelled():
            reader.result()  # re-raises _Closed / WebSocketDisconnect
            return
        if self.key_revoked.is_set():
            raise _Closed(CloseCode.UNAUTHORIZED, "key revoked")
        raise _Closed(CloseCode.POLICY, f"the client is not reading its frames ({self.outbox.qsize()} queued)")

    # ---------------------------------------------------------------- reading

    async def _receive_text(self) -> str | None:
        """The next text frame; None for a binary frame (already answered with an error frame)."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data = message.get("text")
        if data is None:
            raw = message.get("bytes") or b""
            if len(raw) > self.limits.max_message_bytes:
                raise _Closed(CloseCode.TOO_BIG, "message too big")
            self.send(ErrorFrame(code="invalid_frame", message="binary frames are not supported; send JSON text"))
            return None
        if len(data.encode()) > self.limits.max_message_bytes:
            raise _Closed(CloseCode.TOO_BIG, f"message too big (limit {self.limits.max_message_bytes} bytes)")
        return str(data)

    async def _read_hello(self) -> Hello:
        try:
            data = await asyncio.wait_for(self._receive_text(), self.limits.hello_timeout_s)
        except TimeoutError as exc:
            raise _Closed(CloseCode.UNAUTHORIZED, "no hello received") from exc
        frame = parse_client_frame(data) if data is not None else None
        if isinstance(frame, ErrorFrame):
            self.send(frame)  # the error frame says what was wrong; the close reason repeats it
            if frame.message.startswith("hello:"):
                raise _Closed(CloseCode.UNAUTHORIZED, frame.message)  # a hello that names its bad field
            raise _Closed(CloseCode.UNAUTHORIZED, f"the first frame must be hello ({frame.message})")
        if not isinstance(frame, Hello):
            raise _Closed(CloseCode.UNAUTHORIZED, "the first frame must be hello")
        return frame

    def _reserve_early(self, hello: Hello) -> ConnectionKey | None:
        """Count this socket against the caps of the tenant its token belonged to a moment ago, before any database
        work: over a cap, close it with 1013 now (a burst of hellos is refused from memory). The database still
        decides the admission; None when the token is not known."""
        known = self.service.keys.recent(hello.token, KeyKind.CHAT)
        if known is None:
            return None
        return self._connect(ConnectionKey(known.tenant_id, self._client_ref(hello)))

    def _connect(self, client: ConnectionKey) -> ConnectionKey:
        refusal = self.service.hub.try_connect(
            client, self.limits.max_connections_per_tenant, self.limits.max_connections_per_client
        )
        if refusal is not None:
            raise _Closed(CloseCode.TRY_AGAIN_LATER, refusal)
        return client

    def _client_ref(self, hello: Hello) -> str:
        return hello.external_ref or self._client_address()

    async def _authenticate(self, hello: Hello) -> KeyOwner:
        owner = await self.service.keys.owner(hello.token, KeyKind.CHAT)
        if owner is None:
            raise _Closed(CloseCode.UNAUTHORIZED, "invalid token")
        return owner

    def _parse(self, data: str | None) -> AnyClientFrame | None:
        if data is None:
            return None
        frame = parse_client_frame(data)
        if isinstance(frame, ErrorFrame):
            self.send(frame)
            return None
        return frame

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

    async def _dispatch(self, frame: AnyClientFrame) -> None:
        assert self.tenant is not None and self.session_id is not None
        if isinstance(frame, Ping):
            self.send(Pong(nonce=frame.nonce))
        elif isinstance(frame, Typing):
            self.service.desk.customer_typing(self.tenant.id, self.session_id)
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
            except (SQLAlchemyError, OSError):
                # NOTE: the database went away mid-frame (a restart, a failover): the socket stays, the client retries
                # with the same client_msg_id, which is idempotent.
                log.warning("a user.message failed on the database; the client was asked to retry", exc_info=True)
                self.send(
                    ErrorFrame(
                        code="unavailable",
                        message="the message could not be stored; retry it",
                        retry_after_ms=1000,
                        client_msg_id=frame.client_msg_id,
                    )
                )

    # ---------------------------------------------------------------- writing / closing

    async def _write_loop(self) -> None:
        while True:
            text = await self.outbox.get()
            if not isinstance(text, str):  # the close sentinel
                return
            self.queued_bytes -= len(text)
            await self.ws.send_text(text)

    async def _drain_and_close(self, writer: asyncio.Task[None], code: int, reason: str) -> None:
        """Send what is queued (briefly), then the close frame; a client that does not read gets no more time."""
        if not self.too_slow.is_set():
            with contextlib.suppress(asyncio.QueueFull):
                self.outbox.put_nowait(_CLOSE)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer, _DRAIN_TIMEOUT_S)
        writer.cancel()
        if self.ws.client_state != WebSocketState.DISCONNECTED:
            # NOTE: the close frame waits for the socket to be writable; a stalled client must not hold us here.
            with contextlib.suppress(RuntimeError, TimeoutError, OSError):
                await asyncio.wait_for(self.ws.close(code, _close_reason(reason)), _DRAIN_TIMEOUT_S)

    def _client_address(self) -> str:
        return self.ws.client.host if self.ws.client is not None else "unknown"

    def _origin_allowed(self) -> bool:
        allowed = self.limits.allowed_origins
        if "*" in allowed:
            return True
        origin = self.ws.headers.get("origin")
        return origin is None or origin in allowed


_DRAIN_TIMEOUT_S = 2.0


def _close_reason(reason: str) -> str:
    """A close reason fits in 123 bytes of UTF-8 (the frame's limit), cut on a character boundary."""
    return reason.encode()[:120].decode(errors="ignore")
