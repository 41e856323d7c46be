"""Replies cut off by a dead worker, while other workers live: each awaiting customer message gets its ``incomplete``
marker (stored, and sent to the sockets on its session on any worker), so nothing is silently lost.

A lone start marks every awaiting message (``ChatService.recover_interrupted``). With several workers, an awaiting
message may be a live worker's turn in flight, so a worker marks only those no live worker claims. Who is alive is
Postgres' word (``pg_stat_activity``: a killed process's connections end with it), and what each runs is in its
heartbeats (``backend/chat/fanout.py``). A worker counts as dead when its connections are gone and it has been
silent for ``dead_after_s``; a slow worker keeps its connections, so it is never taken for dead.

Every check runs after the heartbeats had time to come in, and skips messages younger than two heartbeats (a live
worker's newest turn may not be in its last heartbeat yet). Marking is idempotent under the session's lock
(``settle_interrupted``): several survivors may sweep at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.fanout import Claims, Fanout
from backend.chat.hub import SessionHub
from backend.chat.protocol import MessageCompleted
from backend.db.models import utcnow
from backend.services import sessions as store

log = logging.getLogger("kvchat.recovery")

CHECK_S = 2.0
DEAD_AFTER_S = 5.0

LiveNames = Callable[[], Awaitable[set[str]]]


class CutOffSweeper:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        hub: SessionHub,
        fanout: Fanout,
        local_claims: Claims,
        live_names: LiveNames,
        check_s: float = CHECK_S,
        dead_after_s: float = DEAD_AFTER_S,
    ) -> None:
        self._sm = sessionmaker
        self._hub = hub
        self._fanout = fanout
        self._local_claims = local_claims
        self._live_names = live_names
        self._check_s = check_s
        self._dead_after_s = dead_after_s

    async def run(self, started_at: datetime) -> None:
        """First the turns cut off before this worker started, then each dead worker's, until cancelled."""
        await asyncio.sleep(self._settle_s)
        await self._guarded(self.sweep, started_at)
        while True:
            await asyncio.sleep(self._check_s)
            await self._guarded(self._check)

    @property
    def _settle_s(self) -> float:
        return 3 * self._fanout.heartbeat_s

    async def _check(self) -> None:
        names = await self._live_names()
        silent = self._fanout.peers.keys() - self._fanout.live_peers(self._dead_after_s).keys()
        dead = sorted(w for w in silent if w not in names)
        if not dead:
            return
        for worker in dead:
            self._fanout.forget(worker)
        log.warning("worker(s) %s are gone: marking the replies they cut off", ", ".join(dead))
        await asyncio.sleep(self._settle_s)
        await self.sweep(utcnow() - timedelta(seconds=2 * self._fanout.heartbeat_s))

    async def sweep(self, before: datetime) -> int:
        """Mark the awaiting messages older than ``before`` that no live worker claims; returns how many."""
        claimed = set(self._local_claims())
        for peer in self._fanout.live_peers(self._dead_after_s).values():
            claimed |= peer.claims
        async with self._sm() as db:
            awaiting = [
                (m.session_id, m.seq, m.client_msg_id)
                for m in await store.awaiting_replies(db)
                if m.created_at < before and (m.session_id, m.client_msg_id or "") not in claimed
            ]
        marked = 0
        for session_id, seq, client_msg_id in awaiting:
            async with self._sm() as db:
                reply = await store.settle_interrupted(db, session_id, seq)
            if reply is None:
                continue
            marked += 1
            if client_msg_id is not None:
                frame = MessageCompleted(
                    client_msg_id=client_msg_id,
                    seq=reply.seq,
                    text="",
                    status=reply.status,
                    finish_reason="interrupted",
                )
                self._hub.publish(session_id, frame)
        if marked:
            log.warning("marked %d repl(ies) cut off by a gone worker as incomplete", marked)
        return marked

    @staticmethod
    async def _guarded(step: Callable[..., Awaitable[object]], *args: object) -> None:
        try:
            await step(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the sweeper must outlive any database error)
            log.warning("cut-off sweep: %s: %s", type(exc).__name__, " ".join(str(exc).split())[:200])
