"""Key lookups under a burst: one database query per key at a time, and a memory of recent answers that is only
ever used to refuse.

``owner`` authenticates a key against the database; callers asking about the same key while a query for it runs
share that query (300 simultaneous hellos with one chat token cost one query, not 300 waits for a pooled
connection). ``recent`` answers from memory who a key belonged to when it last authenticated (within ``TTL_S``, and
not revoked since: ``KeyWatch``), without the database: callers use it only to *refuse* early (a connection cap
already reached), never to admit, so a stale answer can cost a needless "try again later" but never let a revoked
key in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.core.security import hash_key
from backend.domain import KeyKind
from backend.services.revocation import KeyWatch
from backend.services.tenants import KeyOwner, authenticate_key

TTL_S = 30.0
_MAX_REMEMBERED = 10_000  # keys remembered at most (oldest forgotten first): a flood of bad keys stores nothing


@dataclass(frozen=True, slots=True)
class KnownKey:
    """Who a key belonged to when it last authenticated."""

    tenant_id: str
    key_id: str
    seen_at: float


class KeyLookup:
    """Coalesced database lookups of keys, and the memory ``recent`` reads. Used on the event loop only."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        watch: KeyWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._watch = watch
        self._clock = clock
        self._running: dict[tuple[str, KeyKind], asyncio.Task[KeyOwner | None]] = {}
        self._known: dict[tuple[str, KeyKind], KnownKey] = {}
        self.queries = 0  # database lookups run (tests and metrics)

    def recent(self, key: str, kind: KeyKind) -> KnownKey | None:
        """Who ``key`` belonged to when it last authenticated, if that was under ``TTL_S`` ago and it was not revoked
        since; from memory. Only for refusing early (see the module's docstring)."""
        known = self._known.get((hash_key(key), kind))
        if known is None or self._clock() - known.seen_at >= TTL_S or self._watch.revoked_lately(known.key_id):
            return None
        return known

    async def owner(self, key: str, kind: KeyKind) -> KeyOwner | None:
        """``authenticate_key`` against the database, shared with every caller asking about the same key meanwhile."""
        if not key:
            return None
        slot = (hash_key(key), kind)
        task = self._running.get(slot)
        if task is None:
            task = asyncio.create_task(self._query(key, kind), name="kvchat-key-lookup")
            self._running[slot] = task
            task.add_done_callback(lambda _: self._running.pop(slot, None))
        # NOTE: shielded: one caller giving up (its client left) must not cancel the others' answer.
        owner = await asyncio.shield(task)
        if owner is not None:
            self._remember(slot, owner)
        return owner

    async def _query(self, key: str, kind: KeyKind) -> KeyOwner | None:
        self.queries += 1
        async with self._sessionmaker() as db:
            return await authenticate_key(db, key, kind)

    def _remember(self, slot: tuple[str, KeyKind], owner: KeyOwner) -> None:
        self._known.pop(slot, None)
        self._known[slot] = KnownKey(owner.tenant.id, owner.key_id, self._clock())
        while len(self._known) > _MAX_REMEMBERED:
            del self._known[next(iter(self._known))]
