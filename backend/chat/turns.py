"""The turns in flight: at most one per message, one at a time per session (in the order they were started), and how
they end on shutdown (``drain``).

Used on the event loop only. ``backend/chat/turn_path.py`` runs each turn; this module keeps them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from backend.chat.turn_state import Turn
from backend.engine_client.protocol import EngineClient

_STORE_TIMEOUT_S = 15.0  # after the grace period: how long cut-off turns get to store their text
_FLUSH_S = 0.2


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What ``drain`` did: turns that finished within the grace period, and turns it cut off."""

    finished: int
    cut_off: int


class Turns:
    """The turns of one chat service."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._turns: dict[tuple[str, str], Turn] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # turns of a session run one at a time
        self._submit_locks: dict[str, asyncio.Lock] = {}
        self._accepting = True
        self._cutting_off = False  # the drain's grace period is over: a turn that starts now is cut off at once
        self._submitting = 0

    @property
    def accepting(self) -> bool:
        """False once a drain began: no new turns."""
        return self._accepting

    def get(self, session_id: str, client_msg_id: str) -> Turn | None:
        return self._turns.get((session_id, client_msg_id))

    def in_flight(self, session_id: str) -> Turn | None:
        """The session's turn in flight (the earliest started, when several wait their turn)."""
        return next((t for (sid, _), t in self._turns.items() if sid == session_id), None)

    def streaming(self, session_id: str) -> list[Turn]:
        """The session's turns that have published some of their reply (the fan-out's catch-up for another process)."""
        return [t for (sid, _), t in self._turns.items() if sid == session_id and t.parts]

    def claimed(self) -> list[tuple[str, str]]:
        """(session id, client_msg_id) of every turn this process runs or has queued (its fan-out heartbeats)."""
        return list(self._turns)

    def submit_lock(self, session_id: str) -> asyncio.Lock:
        """One submit per session at a time (a retried ``client_msg_id`` racing its original sees its turn)."""
        return self._submit_locks.setdefault(session_id, asyncio.Lock())

    @contextmanager
    def submitting(self) -> Iterator[None]:
        """A message being stored: ``drain`` waits for it too, so a turn decided mid-drain is not lost."""
        self._submitting += 1
        try:
            yield
        finally:
            self._submitting -= 1

    def start(self, turn: Turn, run: Callable[[Turn], Awaitable[None]]) -> None:
        """Run ``run(turn)`` as a task once the session's earlier turns are done."""
        turn.interrupted = self._cutting_off  # (a message stored just as the grace period ended gets its marker)
        self._turns[(turn.session_id, turn.client_msg_id)] = turn
        turn.task = asyncio.create_task(self._run(turn, run), name=f"turn-{turn.session_id}-{turn.client_msg_id}")

    async def _run(self, turn: Turn, run: Callable[[Turn], Awaitable[None]]) -> None:
        try:
            async with self._locks.setdefault(turn.session_id, asyncio.Lock()):
                await run(turn)
        finally:
            self._turns.pop((turn.session_id, turn.client_msg_id), None)

    def cancel(self, session_id: str, client_msg_id: str | None) -> bool:
        """Stop a turn's reply (``client_msg_id``'s, else the session's in flight); False when none runs."""
        turn = self.get(session_id, client_msg_id) if client_msg_id else self.in_flight(session_id)
        if turn is None:
            return False
        turn.cancelled = True
        self._engine.abort(turn.request_id)
        return True

    def forget(self, session_id: str) -> None:
        """A closed or deleted session starts no more turns."""
        self._locks.pop(session_id, None)
        self._submit_locks.pop(session_id, None)

    async def drain(self, grace_s: float) -> DrainReport:
        """Stop taking turns; give those in flight ``grace_s`` to finish while they still stream to the sockets; cut
        off the rest: each is stored ``incomplete`` with exactly the text it published."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        started = len(self._turns)
        await self._wait(loop.time() + grace_s)
        self._cutting_off = True
        left = [t for t in self._turns.values() if not t.interrupted]
        for turn in left:
            turn.interrupted = True
            self._engine.abort(turn.request_id)
        if not await self._wait(loop.time() + _STORE_TIMEOUT_S):
            tasks = [t.task for t in self._turns.values() if t.task is not None]
            for task in tasks:  # NOTE: the last resort (a database that does not answer): cancelled turns store
                task.cancel()  # what they have on the way out, if they can
            await asyncio.gather(*tasks, return_exceptions=True)
        if started:
            # NOTE: publishing only queues frames for each socket's writer task; give the writers a moment to send
            # the last deltas and completions before the server closes the sockets.
            await asyncio.sleep(_FLUSH_S)
        return DrainReport(finished=max(0, started - len(left)), cut_off=len(left))

    async def _wait(self, deadline: float) -> bool:
        """Wait until no turn runs and no message is being stored, or ``deadline``; True when idle."""
        loop = asyncio.get_running_loop()
        while self._turns or self._submitting:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            tasks = {t.task for t in self._turns.values() if t.task is not None}
            if tasks:
                await asyncio.wait(tasks, timeout=remaining)
            else:
                await asyncio.sleep(min(0.05, remaining))
        return True

    async def wait_idle(self) -> None:
        """Wait for every turn in flight to finish (tests)."""
        while self._turns:
            tasks = [t.task for t in self._turns.values() if t.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)
