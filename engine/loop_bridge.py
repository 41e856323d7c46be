"""Events from the step thread to the asyncio loop of their callers, one wake-up per burst.

Every event of a step (a token for each sequence of the batch, the endings) used to be one ``call_soon_threadsafe``:
a write to the loop's self-pipe and a callback each. The bridge appends to one list and wakes the loop only when the
list was empty, so a step's events reach the loop as one hand-off, in the order they were put; the loop then fills
each request's queue. One bridge per loop (``LLMEngine.generate`` makes it on first use).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any


class LoopBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # (weak: the engine keeps one bridge per loop, keyed weakly by the loop)
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """From any thread: ``item`` into ``queue`` on the loop, after every item put before it.

        NOTE: a closed loop drops the item (and what is pending): nobody is left to receive it, and raising into the
        step thread would fail every other request of its batch."""
        with self._lock:
            wake = not self._pending
            self._pending.append((queue, item))
        if wake:
            loop = self._loop()
            try:
                if loop is None:
                    raise RuntimeError("the loop is gone")
                loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                with self._lock:
                    self._pending.clear()

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, item in batch:
            queue.put_nowait(item)
