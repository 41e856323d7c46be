"""Event-loop and database work, bounded and fair across tenants: the async sibling of ``offload.FairExecutor``.

``async with gate.hold(owner): ...`` lets at most ``capacity`` holders in at once. While there is room a caller
enters at once (work-conserving: a lone tenant may take every slot). When the gate is full, callers wait in one FIFO
queue per owner (a tenant), and each slot that frees goes to the waiting owner that holds the fewest slots (the freed
one still counted as its releaser's), the owner that has waited longest on a tie (then the owners take turns). So one
tenant's burst cannot make another wait behind all of it: a tenant with nothing in takes the next slot that frees
(unless other tenants with nothing in waited longer).

NOTE: why (issue 42). First come, first served, tenant A's 60 sessions each sending a message at once took the
database pool's connections and the loop's time in arrival order: tenant B's next message was stored after 1,855 ms
(Postgres, ``bench/fairness.py``) against ~15 ms when A was quiet. The chat turn path holds a slot for the message's
check and its storing transaction (``backend/chat/turn_path.py``, steps 1 and 2).

NOTE: a slot is handed to the chosen waiter when it frees (counted as the waiter's at once), never left for the
waiters to race for; so a waiter cancelled after its grant, before it ran, hands the slot on in its turn.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairGate:
    """At most ``capacity`` holders; when full, freed slots go to the waiting owner holding the fewest."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a FairGate needs a capacity of at least 1")
        self._capacity = capacity
        self._total = 0  # slots held, all owners
        self._held: dict[str, int] = {}  # owners holding a slot (granted, whether or not their block began)
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}  # owners with a waiter, each in arrival order
        self._line: deque[str] = deque()  # the owners in ``_queues``: the longest waiting first, then in turn

    @property
    def capacity(self) -> int:
        return self._capacity

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        """Hold one slot for the block, waiting for one in the owner's turn when the gate is full."""
        await self._acquire(owner)
        try:
            yield
        finally:
            self._release(owner)

    @property
    def full(self) -> bool:
        """Whether a caller would wait for a slot now."""
        return self._total >= self._capacity

    def held(self) -> dict[str, int]:
        """Slots held, per owner (for tests and metrics)."""
        return dict(self._held)

    def waiting(self) -> dict[str, int]:
        """Callers waiting for a slot, per owner (for tests and metrics)."""
        return {owner: sum(not f.done() for f in queue) for owner, queue in self._queues.items()}

    async def _acquire(self, owner: str) -> None:
        if self._total < self._capacity and not self._line:
            self._take(owner)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(owner)
        if queue is None:
            self._queues[owner] = queue = deque()
            self._line.append(owner)
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(owner)  # granted, then cancelled before it ran: the slot goes on to the next waiter
            else:
                self._forget(owner, waiter)
            raise

    def _take(self, owner: str) -> None:
        self._total += 1
        self._held[owner] = self._held.get(owner, 0) + 1

    def _release(self, owner: str) -> None:
        self._total -= 1
        # NOTE: chosen while the freed slot still counts as its releaser's, so on a tie it goes to another owner
        # (with one slot, the releaser would hold none and, waiting longest, win it back: B behind all of A again)
        while self._total < self._capacity and self._line:
            self._grant_next()
        held = self._held[owner] - 1
        if held:
            self._held[owner] = held
        else:
            del self._held[owner]

    def _grant_next(self) -> None:
        """The freed slot to the waiting owner holding the fewest (the first in line on a tie), its oldest waiter."""
        owner = min(self._line, key=lambda o: self._held.get(o, 0))  # (min keeps the first of equals)
        self._line.remove(owner)
        queue = self._queues[owner]
        waiter = queue.popleft()
        while waiter.done():  # NOTE: cancelled, its task not yet run to forget it
            if not queue:
                del self._queues[owner]
                return
            waiter = queue.popleft()
        if queue:
            self._line.append(owner)  # NOTE: at the end of the line: the owners take turns
        else:
            del self._queues[owner]
        self._take(owner)
        waiter.set_result(None)

    def _forget(self, owner: str, waiter: asyncio.Future[None]) -> None:
        """A waiter cancelled before its grant leaves its queue (it may have left it already)."""
        queue = self._queues.get(owner)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        if not queue:
            del self._queues[owner]
            self._line.remove(owner)
