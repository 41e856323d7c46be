"""Fan-out across server processes: several ``kvchat serve`` workers on one Postgres database act as one chat
service. Postgres ``LISTEN/NOTIFY`` carries it (no in-process state, no other broker):

- **Frames.** Every frame a turn publishes (``SessionHub.publish``) also goes out on ``kvchat_chat``; every other
  worker delivers it to its own sockets on that session (``SessionHub.deliver_remote``). A customer who reconnects to
  another worker mid-reply gets the text so far in ``welcome.in_flight`` and the rest as deltas: the hub reads the
  text and subscribes the socket in one step of the event loop, and frames are handled in the order sent, so there is
  no gap and no duplicate.
- **Heartbeats**, every ``HEARTBEAT_S`` and soon after a socket opens or closes: the worker's socket counts per tenant
  and per client (so the connection caps hold across workers) and the turns it is running (so a survivor knows which
  awaiting messages were a dead worker's: ``backend/chat/recovery.py``).

Ordering: one sender task sends this worker's messages in order on its own connection; Postgres delivers a
session's notifications in that order. Each message carries the worker's name and a counter (Postgres drops a
duplicate payload within one transaction: the counter makes every payload unique). NOTIFY payloads are under 8,000
bytes: a longer message goes out in parts and is put together again on arrival.

NOTE: a notification sent while a worker's listening connection is down (a Postgres restart) is lost to that
worker: its sockets miss those frames and see the stored reply on their next resume (``last_seq``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

import asyncpg
from pydantic import Field, TypeAdapter, ValidationError
from sqlalchemy.engine import make_url

from backend.chat.hub import ConnectionKey, SessionHub
from backend.chat.protocol import ServerFrame

log = logging.getLogger("kvchat.fanout")

CHANNEL = "kvchat_chat"
HEARTBEAT_S = 1.0
RECONNECT_S = 1.0
_COUNTS_DEBOUNCE_S = 0.05  # a burst of connects is announced once
_MAX_PAYLOAD = 7_000  # characters of one NOTIFY (Postgres' limit is 8,000 bytes)
_BATCH = 200  # messages sent in one statement
_QUEUE_MAX = 100_000  # messages waiting while the database is away; past it, new ones are dropped (and counted)

_FRAME: TypeAdapter[ServerFrame] = TypeAdapter(Annotated[ServerFrame, Field(discriminator="type")])

Claims = Callable[[], Iterable[tuple[str, str]]]


@dataclass(slots=True)
class Peer:
    """Another worker, as its heartbeats describe it."""

    heard_at: float
    claims: frozenset[tuple[str, str]] = frozenset()  # (session id, client_msg_id) of the turns it runs


@dataclass(slots=True)
class _Parts:
    total: int
    parts: dict[int, str] = field(default_factory=dict)


class Fanout:
    """This worker's end of the fan-out (see the module's docstring). Runs on the event loop."""

    def __init__(
        self, database_url: str, worker: str, hub: SessionHub, claims: Claims, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self.worker = worker
        self.heartbeat_s = heartbeat_s
        self.peers: dict[str, Peer] = {}
        self._dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._hub = hub
        self._claims = claims
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=_QUEUE_MAX)
        self._dropped = 0
        self._counter = 0
        self._parts: dict[tuple[str, int], _Parts] = {}
        self._counts_dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._hub.relay = self._relay
        self._hub.on_counts_changed = self._counts_dirty.set
        self._tasks = [
            asyncio.create_task(self._forever(self._listen_once), name="kvchat-fanout-listen"),
            asyncio.create_task(self._forever(self._send_once), name="kvchat-fanout-send"),
            asyncio.create_task(self._heartbeats(), name="kvchat-fanout-heartbeat"),
        ]

    async def stop(self) -> None:
        self._hub.relay = None
        self._hub.on_counts_changed = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def live_peers(self, within_s: float) -> dict[str, Peer]:
        """The workers heard from in the last ``within_s`` seconds."""
        now = time.monotonic()
        return {w: p for w, p in self.peers.items() if now - p.heard_at <= within_s}

    def forget(self, worker: str) -> None:
        """``worker`` is gone (``backend/chat/recovery.py`` decides): drop what it announced."""
        self.peers.pop(worker, None)
        self._hub.drop_worker(worker)

    # ------------------------------------------------------------------ sending

    def _relay(self, session_id: str, frame: ServerFrame) -> None:
        self._put({"k": "f", "s": session_id, "f": frame.model_dump(mode="json")})

    def _put(self, message: dict[str, Any]) -> None:
        self._counter += 1
        message["w"], message["n"] = self.worker, self._counter
        body = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
        if len(body.encode()) <= _MAX_PAYLOAD:
            self._enqueue(body)
            return
        # NOTE: parts are cut by characters and sized for 4-byte characters, so each fits in bytes too
        step = _MAX_PAYLOAD // 4 - 100
        chunks = [body[i : i + step] for i in range(0, len(body), step)]
        for i, chunk in enumerate(chunks):
            part = {"k": "p", "w": self.worker, "n": self._counter, "i": i, "t": len(chunks), "d": chunk}
            self._enqueue(json.dumps(part, separators=(",", ":"), ensure_ascii=False))

    def _enqueue(self, payload: str) -> None:
        try:
            self._queue.put_nowait(payload)
        except asyncio.QueueFull:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 10_000 == 0:
                log.warning("fan-out: the database is away; %d message(s) dropped so far", self._dropped)

    async def _send_once(self) -> None:
        conn = await asyncpg.connect(self._dsn, server_settings={"application_name": self.worker})
        try:
            while True:
                batch = [await self._queue.get()]
                while len(batch) < _BATCH and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                # NOTE: one statement, notifications in array order (WITH ORDINALITY keeps it explicit)
                await conn.execute(
                    "SELECT pg_notify($1, p) FROM unnest($2::text[]) WITH ORDINALITY AS t(p, i) ORDER BY i",
                    CHANNEL,
                    batch,
                )
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=1)

    async def _heartbeats(self) -> None:
        while True:
            self._counts_dirty.clear()
            tenants, clients = self._hub.local_counts()
            self._put(
                {
                    "k": "h",
                    "t": tenants,
                    "c": [[k.tenant_id, k.client, n] for k, n in clients.items()],
                    "r": [list(c) for c in self._claims()],
                }
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._counts_dirty.wait(), self.heartbeat_s)
                await asyncio.sleep(_COUNTS_DEBOUNCE_S)

    # ------------------------------------------------------------------ receiving

    async def _listen_once(self) -> None:
        lost = asyncio.Event()
        conn = await asyncpg.connect(self._dsn, server_settings={"application_name": self.worker})
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL, self._heard)
            await lost.wait()
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=1)

    def _heard(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            message = json.loads(payload)
            if message.get("w") == self.worker:
                return
            if message.get("k") == "p":
                message = self._assemble(message)
                if message is None:
                    return
            self._handle(message)
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            log.warning("fan-out: dropped a malformed message: %s", type(exc).__name__)

    def _assemble(self, part: dict[str, Any]) -> dict[str, Any] | None:
        key = (part["w"], part["n"])
        parts = self._parts.setdefault(key, _Parts(int(part["t"])))
        parts.parts[int(part["i"])] = part["d"]
        if len(parts.parts) < parts.total:
            return None
        del self._parts[key]
        whole: dict[str, Any] = json.loads("".join(parts.parts[i] for i in range(parts.total)))
        return whole

    def _handle(self, message: dict[str, Any]) -> None:
        worker = message["w"]
        if message["k"] == "f":
            self._hub.deliver_remote(worker, message["s"], _FRAME.validate_python(message["f"]))
        elif message["k"] == "h":
            clients = {ConnectionKey(t, c): int(n) for t, c, n in message["c"]}
            self._hub.set_remote_counts(worker, {t: int(n) for t, n in message["t"].items()}, clients)
            claims = frozenset((s, c) for s, c in message["r"])
            self.peers[worker] = Peer(time.monotonic(), claims)

    @staticmethod
    async def _forever(step: Callable[[], Any]) -> None:
        """Run ``step`` again after each loss of its connection; a database away is one log line, never fatal."""
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the fan-out must outlive any database error)
                log.warning("fan-out: %s: %s", type(exc).__name__, " ".join(str(exc).split())[:200])
            await asyncio.sleep(RECONNECT_S)
