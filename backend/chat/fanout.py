"""Fan-out across server processes: several ``kvchat serve`` workers on one Postgres database act as one chat
service. Postgres ``LISTEN/NOTIFY`` carries it (no in-process state, no other broker):

- **Frames, to the workers that hear the session.** Every frame a turn publishes (``SessionHub.publish``) also goes
  out on the session's own channel (``channel_of``: ``kvchat_k_`` and a hash of the hub key); a worker LISTENs to the
  channels of the keys its sockets follow (``SessionHub.followed``) and to nothing else, so a worker without a socket
  of a session hears none of its deltas. It delivers what it hears to its own sockets (``SessionHub.deliver_remote``).
- **Catching up.** A customer who reconnects to another worker mid-reply gets the text so far in ``welcome.in_flight``
  and the rest as deltas. Before the welcome (``SessionHub.following``) the worker LISTENs to the session, then asks
  every live worker (a query on the common channel) for its replies in flight there; each answers on the session's
  channel, after the deltas it sent before, so the answer replaces what was heard of them and the deltas after it
  add on. The hub then reads the text and subscribes the socket in one step of the event loop: no gap, no duplicate.
  A worker that does not answer within ``CATCH_UP_S`` (dying) is not waited for longer.
- **Heartbeats**, on the common channel (``kvchat_chat``) that every worker hears, every ``HEARTBEAT_S`` and soon
  after a socket opens or closes: the worker's socket counts per tenant and per client (so the connection caps hold
  across workers) and the turns it is running (so a survivor knows which awaiting messages were a dead worker's:
  ``backend/chat/recovery.py``).

Ordering: one sender task sends this worker's messages in order on its own connection; Postgres delivers a
channel's notifications in that order. Each message carries the worker's name and a counter (Postgres drops a
duplicate payload within one transaction: the counter makes every payload unique). NOTIFY payloads are under 8,000
bytes: a longer message goes out in parts and is put together again on arrival.

NOTE: a notification sent while a worker's listening connection is down (a Postgres restart) is lost to that
worker: its sockets miss those frames and see the stored reply on their next resume (``last_seq``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

import asyncpg
from pydantic import Field, TypeAdapter, ValidationError
from sqlalchemy.engine import make_url

from backend.chat.hub import ConnectionKey, RemoteReply, SessionHub
from backend.chat.protocol import ServerFrame

log = logging.getLogger("kvchat.fanout")

CHANNEL = "kvchat_chat"
_KEY_CHANNEL = "kvchat_k_"
HEARTBEAT_S = 1.0
CATCH_UP_S = 0.5  # how long a welcome waits for the other workers' replies in flight
RECONNECT_S = 1.0
_COUNTS_DEBOUNCE_S = 0.05  # a burst of connects is announced once
_MAX_PAYLOAD = 7_000  # characters of one NOTIFY (Postgres' limit is 8,000 bytes)
_BATCH = 200  # messages sent in one statement
_QUEUE_MAX = 100_000  # messages waiting while the database is away; past it, new ones are dropped (and counted)

_FRAME: TypeAdapter[ServerFrame] = TypeAdapter(Annotated[ServerFrame, Field(discriminator="type")])

Claims = Callable[[], Iterable[tuple[str, str]]]
Replies = Callable[[str], Iterable[tuple[str, str]]]  # a session's replies streaming here: (client_msg_id, text)


def channel_of(key: str) -> str:
    """The NOTIFY channel of a hub key (a session id, an inbox): a valid identifier under Postgres' 63 bytes."""
    return _KEY_CHANNEL + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


@dataclass(slots=True)
class Peer:
    """Another worker, as its heartbeats describe it."""

    heard_at: float
    claims: frozenset[tuple[str, str]] = frozenset()  # (session id, client_msg_id) of the turns it runs


@dataclass(slots=True)
class _Query:
    """A catch-up this worker asked for: who has not answered yet."""

    waiting: set[str]
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _Parts:
    total: int
    parts: dict[int, str] = field(default_factory=dict)


class Fanout:
    """This worker's end of the fan-out (see the module's docstring). Runs on the event loop."""

    def __init__(
        self,
        database_url: str,
        worker: str,
        hub: SessionHub,
        claims: Claims,
        replies: Replies = lambda _key: (),
        heartbeat_s: float = HEARTBEAT_S,
        on_frame: Callable[[], None] = lambda: None,
    ) -> None:
        self.worker = worker
        self.heartbeat_s = heartbeat_s
        self.peers: dict[str, Peer] = {}
        self._dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._hub = hub
        self._claims = claims
        self._replies = replies
        self._on_frame = on_frame  # (kvchat:fanout_frames_heard)
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(maxsize=_QUEUE_MAX)  # (channel, payload)
        self._dropped = 0
        self._counter = 0
        self._parts: dict[tuple[str, int], _Parts] = {}
        self._counts_dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # which keys this worker hears: those its sockets follow, and those held while a socket is welcomed
        self._held: Counter[str] = Counter()
        self._listening: set[str] = set()  # LISTENed on the current connection
        self._keys_dirty = asyncio.Event()
        self._joins: dict[str, asyncio.Task[None]] = {}  # a key's listen and catch-up, shared by its welcomes
        self._queries: dict[int, _Query] = {}
        self._listened = asyncio.Event()  # set (and replaced) each time the LISTENs catch up with the keys wanted
        self.frames_heard = 0  # frames of sessions heard from the other workers (the tests, and a reader's check)

    def start(self) -> None:
        self._hub.relay = self._relay
        self._hub.on_counts_changed = self._counts_dirty.set
        self._hub.on_keys_changed = self._keys_dirty.set
        self._hub.follow = self.following
        self._tasks = [
            asyncio.create_task(self._forever(self._listen_once), name="kvchat-fanout-listen"),
            asyncio.create_task(self._forever(self._send_once), name="kvchat-fanout-send"),
            asyncio.create_task(self._heartbeats(), name="kvchat-fanout-heartbeat"),
        ]

    async def stop(self) -> None:
        self._hub.relay = None
        self._hub.on_counts_changed = None
        self._hub.on_keys_changed = None
        self._hub.follow = None
        for task in [*self._tasks, *self._joins.values()]:
            task.cancel()
        for task in [*self._tasks, *self._joins.values()]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._joins = {}

    def live_peers(self, within_s: float) -> dict[str, Peer]:
        """The workers heard from in the last ``within_s`` seconds."""
        now = time.monotonic()
        return {w: p for w, p in self.peers.items() if now - p.heard_at <= within_s}

    def forget(self, worker: str) -> None:
        """``worker`` is gone (``backend/chat/recovery.py`` decides): drop what it announced."""
        self.peers.pop(worker, None)
        self._hub.drop_worker(worker)

    # ------------------------------------------------------------------ which sessions this worker hears

    @contextlib.asynccontextmanager
    async def following(self, key: str) -> AsyncIterator[None]:
        """Hear ``key`` while the block runs (``SessionHub.following``), caught up on the other workers' replies in
        flight there on entry. A database that does not answer costs the welcome ``CATCH_UP_S``, not the socket."""
        self._held[key] += 1
        self._keys_dirty.set()
        try:
            join = self._joins.get(key)
            if join is None:
                join = self._joins[key] = asyncio.create_task(self._join(key), name="kvchat-fanout-join")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(join), 2 * CATCH_UP_S)
            yield
        finally:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
            # NOTE: the caller subscribed its socket first (same loop step): the key stays heard, no UNLISTEN
            self._keys_dirty.set()

    async def _join(self, key: str) -> None:
        """LISTEN to ``key``, then ask the live workers for their replies in flight there and wait for the answers."""
        while key not in self._listening:
            await self._listened.wait()
        peers = set(self.live_peers(3 * self.heartbeat_s))
        if not peers:
            return
        self._counter += 1
        number = self._counter
        query = self._queries[number] = _Query(peers)
        self._put({"k": "q", "s": key, "q": number})
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(query.done.wait(), CATCH_UP_S)
        finally:
            self._queries.pop(number, None)

    def _wanted(self) -> set[str]:
        return self._hub.followed() | set(self._held)

    def _wants(self, key: str) -> bool:
        return key in self._held or self._hub.subscriber_count(key) > 0

    def _drop_join(self, key: str) -> None:
        join = self._joins.pop(key, None)
        if join is not None:
            join.cancel()

    async def _follow_keys(self, conn: asyncpg.Connection) -> None:
        """Keep the connection's LISTENs equal to the keys wanted, as they change; never returns."""
        while True:
            self._keys_dirty.clear()
            wanted = self._wanted()
            for key in wanted - self._listening:
                await conn.add_listener(channel_of(key), self._heard)
                self._listening.add(key)
            for key in self._listening - wanted:
                await conn.remove_listener(channel_of(key), self._heard)
                self._listening.discard(key)
                self._drop_join(key)
                self._hub.forget_remote(key)
            self._listened.set()
            self._listened = asyncio.Event()
            await self._keys_dirty.wait()

    # ------------------------------------------------------------------ sending

    def _relay(self, session_id: str, frame: ServerFrame) -> None:
        self._put({"k": "f", "s": session_id, "f": frame.model_dump(mode="json")}, channel_of(session_id))

    def _put(self, message: dict[str, Any], channel: str = CHANNEL) -> None:
        self._counter += 1
        message["w"], message["n"] = self.worker, self._counter
        body = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
        if len(body.encode()) <= _MAX_PAYLOAD:
            self._enqueue(channel, body)
            return
        # NOTE: parts are cut by characters and sized for 4-byte characters, so each fits in bytes too
        step = _MAX_PAYLOAD // 4 - 100
        chunks = [body[i : i + step] for i in range(0, len(body), step)]
        for i, chunk in enumerate(chunks):
            part = {"k": "p", "w": self.worker, "n": self._counter, "i": i, "t": len(chunks), "d": chunk}
            self._enqueue(channel, json.dumps(part, separators=(",", ":"), ensure_ascii=False))

    def _enqueue(self, channel: str, payload: str) -> None:
        try:
            self._queue.put_nowait((channel, payload))
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
                    "SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(c, p, i) "
                    "ORDER BY i",
                    [c for c, _ in batch],
                    [p for _, p in batch],
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
        self._listening = set()
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL, self._heard)
            follow = asyncio.create_task(self._follow_keys(conn), name="kvchat-fanout-keys")
            gone = asyncio.create_task(lost.wait(), name="kvchat-fanout-lost")
            try:
                await asyncio.wait([follow, gone], return_when=asyncio.FIRST_COMPLETED)
                if follow.done():
                    follow.result()  # (raises the connection's error: the caller reconnects)
            finally:
                for task in (follow, gone):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            # NOTE: frames sent while no connection listens are lost here; what was known of them goes stale
            for key in self._listening:
                self._hub.forget_remote(key)
                self._drop_join(key)
            self._listening = set()
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
        worker, kind = message["w"], message["k"]
        if kind == "f":
            self.frames_heard += 1
            self._on_frame()
            if self._wants(message["s"]):  # (not one heard between its last socket's leaving and the UNLISTEN)
                self._hub.deliver_remote(worker, message["s"], _FRAME.validate_python(message["f"]))
        elif kind == "h":
            clients = {ConnectionKey(t, c): int(n) for t, c, n in message["c"]}
            self._hub.set_remote_counts(worker, {t: int(n) for t, n in message["t"].items()}, clients)
            claims = frozenset((s, c) for s, c in message["r"])
            self.peers[worker] = Peer(time.monotonic(), claims)
        elif kind == "q":
            key = message["s"]
            answer = [[c, t] for c, t in self._replies(key)]
            self._put({"k": "a", "s": key, "q": message["q"], "to": worker, "r": answer}, channel_of(key))
        elif kind == "a" and message["to"] == self.worker:
            for client_msg_id, text in message["r"] if self._wants(message["s"]) else ():
                self._hub.set_remote_reply(message["s"], RemoteReply(worker, client_msg_id, text))
            query = self._queries.get(int(message["q"]))
            if query is not None:
                query.waiting.discard(worker)
                if not query.waiting:
                    query.done.set()

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
