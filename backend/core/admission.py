"""Admission of ``/v1`` completions: how many are running in this process, refused in memory past the engine's
capacity, and how many are starting at once.

``AdmissionGuard`` (``backend/api/boundary.py``) counts a request from its first byte to its last, so a burst beyond
what the engine can queue (``max_num_seqs`` running + ``max_waiting``) is refused with a 503 at once, before it is
parsed, authenticated or tokenized (400 streams at once: the last refusal took 3.5 s before). The engine's own check
stays: chat turns share the engine and are not counted here, so with the engine full of them a ``/v1`` request is
still refused by the engine, after tokenizing.

An admitted request then waits for one of ``MAX_STARTING`` start slots before its body is read, and gives it back
once its work on the event loop is done (``started()``, when it is handed to the CPU workers; at the latest when it
ends). Why: a burst's admitted requests would otherwise all parse, authenticate and render on the loop at once (288
of them woke together when their shared key lookup returned), and a refusal that arrived meanwhile waited behind all
of that: 258 ms p50 for the 503s of 400 streams against a full queue. With the slots, a refusal waits behind at
most ``MAX_STARTING`` requests' start, which is what "refusals first" asks.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

RETRY_AFTER_S = 1.0  # the engine's own hint when its queue is full (engine.scheduler.SchedulerConfig.retry_after_s)
MAX_STARTING = 8  # admitted requests doing their start's work on the event loop at once


@dataclass(slots=True)
class _Slot:
    """One request's start slot; released once."""

    gate: asyncio.Semaphore
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gate.release()


_current: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("kvchat_start_slot", default=None)


def started() -> None:
    """The current request's work on the event loop is done (it is handed to the CPU workers or the engine): its
    start slot goes to the next admitted request. A no-op outside an admitted request."""
    slot = _current.get()
    if slot is not None:
        slot.release()


@dataclass(slots=True)
class Admission:
    """Requests admitted and not finished, up to ``capacity`` (the engine's: set when the app starts, from the
    engine's configuration), and the start slots. Used on the event loop only."""

    capacity: int
    max_body_bytes: int | None = None  # the largest useful body (backend/openai/body_bound.py); None: the global cap
    admitted: int = 0
    starting: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_STARTING))

    def try_enter(self) -> bool:
        """Count one more request, or refuse (False) when ``capacity`` are in already."""
        if self.admitted >= self.capacity:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted = max(0, self.admitted - 1)

    @asynccontextmanager
    async def start_slot(self) -> AsyncIterator[None]:
        """Hold a start slot from here until ``started()`` or the block's end, whichever comes first."""
        await self.starting.acquire()
        slot = _Slot(self.starting)
        token = _current.set(slot)
        try:
            yield
        finally:
            slot.release()
            _current.reset(token)
