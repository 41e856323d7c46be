"""Revoked keys reach live connections: a websocket opened with a key is closed (4401 "key revoked") within a second
of that key's rotation or revocation, in every server process.

Three parts:

- ``KeyWatch``, in each process: the live connections per key id, each with the callback that closes it. It also
  remembers the keys revoked in the last minute, so a connection that authenticated just before a revocation and
  registers just after it is closed at once instead of missed.
- ``announce_revoked``, in the revoking transaction: on Postgres a ``NOTIFY kvchat_keys_revoked`` carrying the key
  ids, which Postgres delivers to every listening process when (and only if) the transaction commits. The process
  that revoked also tells its own ``KeyWatch`` directly after the commit (the fast path: no round trip).
- ``RevocationFeed``, in each server process: on Postgres it ``LISTEN``s on its own connection and, after every
  (re)connect, asks the database which watched keys were revoked meanwhile (a notification sent while it was
  disconnected is lost, so it catches up instead). On SQLite (one server process, but ``kvchat keys revoke`` runs in
  another) it asks the same question every ``POLL_S``.

NOTE: only websockets are closed. An in-flight ``/v1`` request of a revoked bearer key runs to its end (it was
authorized when it started, and ends within its ``max_tokens``); every later request with that key gets a 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import asyncpg
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.db.models import ApiKey

log = logging.getLogger("kvchat.revocation")

CHANNEL = "kvchat_keys_revoked"
POLL_S = 0.5  # SQLite: how often the watched keys are checked
RECONNECT_S = 1.0  # Postgres: the wait before listening again after the connection was lost
_REMEMBER_S = 60.0  # a revocation is remembered this long for connections that register late
_ID_CHUNK = 500  # key ids per catch-up query

OnRevoked = Callable[[], None]


class KeyWatch:
    """The live connections of each key, and the keys revoked lately. Used on the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._watchers: dict[str, dict[int, OnRevoked]] = {}
        self._recent: dict[str, float] = {}  # key id -> when its revocation was heard
        self._next = 0

    def watch(self, key_id: str, on_revoked: OnRevoked) -> int:
        """Call ``on_revoked`` once when ``key_id`` is revoked (at once if it was, lately); returns a token for
        ``unwatch``."""
        self._next += 1
        if self.revoked_lately(key_id):
            on_revoked()
            return self._next
        self._watchers.setdefault(key_id, {})[self._next] = on_revoked
        return self._next

    def unwatch(self, key_id: str, token: int) -> None:
        watchers = self._watchers.get(key_id)
        if watchers is not None:
            watchers.pop(token, None)
            if not watchers:
                del self._watchers[key_id]

    def watched(self) -> list[str]:
        """The key ids with a live connection."""
        return list(self._watchers)

    def revoked(self, key_ids: Iterable[str]) -> int:
        """``key_ids`` are revoked: call (and forget) their connections' callbacks. Returns how many were called."""
        now = self._clock()
        self._recent = {k: t for k, t in self._recent.items() if now - t < _REMEMBER_S}
        called = 0
        for key_id in key_ids:
            self._recent[key_id] = now
            for on_revoked in self._watchers.pop(key_id, {}).values():
                on_revoked()
                called += 1
        return called

    def revoked_lately(self, key_id: str) -> bool:
        """Whether ``key_id``'s revocation was heard in the last minute."""
        heard = self._recent.get(key_id)
        return heard is not None and self._clock() - heard < _REMEMBER_S


async def announce_revoked(db: AsyncSession, key_ids: Iterable[str]) -> None:
    """Tell every server process, once the caller's transaction commits, that ``key_ids`` are revoked (Postgres: a
    ``NOTIFY``; SQLite has none, and its ``RevocationFeed`` polls instead)."""
    ids = sorted(set(key_ids))
    if ids and db.get_bind().dialect.name == "postgresql":
        # NOTE: key ids are 36-character uuids: even a whole tenant's keys fit in NOTIFY's 8,000-byte payload.
        await db.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": ",".join(ids)})


async def revoked_among(db: AsyncSession, key_ids: list[str]) -> list[str]:
    """Which of ``key_ids`` are revoked now."""
    found: list[str] = []
    for start in range(0, len(key_ids), _ID_CHUNK):
        chunk = key_ids[start : start + _ID_CHUNK]
        rows = await db.execute(select(ApiKey.id).where(ApiKey.id.in_(chunk), ApiKey.revoked_at.is_not(None)))
        found.extend(rows.scalars())
    return found


class RevocationFeed:
    """Feeds revocations made by any process into this process's ``KeyWatch`` (see the module's docstring)."""

    def __init__(self, database_url: str, sessionmaker: async_sessionmaker[AsyncSession], watch: KeyWatch) -> None:
        self._url = make_url(database_url)
        self._sessionmaker = sessionmaker
        self._watch = watch
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        postgres = self._url.get_backend_name() == "postgresql"
        self._task = asyncio.create_task(self._listen() if postgres else self._poll(), name="kvchat-revocations")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def catch_up(self) -> int:
        """Close the connections of watched keys that the database says are revoked; returns how many."""
        watched = self._watch.watched()
        if not watched:
            return 0
        async with self._sessionmaker() as db:
            return self._watch.revoked(await revoked_among(db, watched))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self._guarded(self.catch_up)

    async def _listen(self) -> None:
        while True:
            await self._guarded(self._listen_once)
            await asyncio.sleep(RECONNECT_S)

    async def _listen_once(self) -> None:
        """Listen until the connection is lost (a Postgres restart, a failover)."""
        lost = asyncio.Event()
        dsn = self._url.set(drivername="postgresql").render_as_string(hide_password=False)
        conn = await asyncpg.connect(dsn, server_settings={"application_name": "kvchat-revocations"})
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL, self._heard)
            await self.catch_up()  # NOTE: after LISTEN: a revocation between the two is heard, or found, or both
            await lost.wait()
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=1)

    def _heard(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self._watch.revoked(k for k in payload.split(",") if k)

    @staticmethod
    async def _guarded(step: Callable[[], Any]) -> None:
        """Run one step; a database that is away is logged in one line and tried again, never fatal."""
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the feed must outlive any database error)
            log.warning("revocation feed: %s: %s", type(exc).__name__, " ".join(str(exc).split())[:200])
