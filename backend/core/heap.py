"""The server's long-lived heap, kept out of Python's cyclic garbage collector while it serves.

Why: once the model, the tokenizer and the app are loaded, the process tracks ~370,000 container objects (SmolLM2,
transformers, FastAPI, SQLAlchemy), and every full (generation-2) collection walks them all: 236 ms measured on a
2-core Zen 5, with the GIL held, so the engine's step loop and the event loop both stall for it (a token's latency
jumps by that much whenever one lands mid-request). Those objects live as long as the server, so after startup they
are moved to the collector's permanent generation (``gc.freeze``, after one ``gc.collect`` so no garbage is frozen
with them); a full collection then walks only what serving allocated since (measured: 0.0 ms right after). On
shutdown they are handed back (``gc.unfreeze``), so an app that is stopped (tests start many) can be collected.

What serving frees goes back to the system once a run of sockets or requests has closed (``FreedMemoryReleaser``):
without it, the RSS a burst took stays after the burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def long_lived_heap_frozen() -> Iterator[int]:
    """Collect once, then freeze every object tracked now for the ``with`` block; yields how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    # NOTE: debug: a figure for whoever measures pauses (this module's docstring), not news for an operator.
    log.debug("gc.freeze: %d objects of the start kept out of full garbage collections while serving", frozen)
    try:
        yield frozen
    finally:
        gc.unfreeze()


def release_freed_memory() -> None:
    """Collect garbage, then hand the C heap's free pages back to the system (glibc's ``malloc_trim``).

    Why: the buffers a burst of sockets or requests allocated are freed when they close, but glibc keeps freed heap
    pages mapped (only the top of each arena is returned, and each thread that allocated has its own arena), so the
    process's RSS stays at the burst's peak. ``malloc_trim(0)`` returns every free page of every arena. Not glibc (musl,
    macOS): the collection alone.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class FreedMemoryReleaser:
    """Releases freed memory (``release_freed_memory``, in a thread) once things close: ``quiet_s`` after the last
    ``closed()`` of a run of them, and at most once every ``min_interval_s``, so a burst of closes costs one release.
    Used on the event loop only."""

    def __init__(
        self, quiet_s: float = 1.0, min_interval_s: float = 5.0, release: Callable[[], None] = release_freed_memory
    ) -> None:
        self.quiet_s = quiet_s
        self.min_interval_s = min_interval_s
        self.releases = 0
        self._release = release
        self._last_close = 0.0
        self._last_release = -math.inf
        self._task: asyncio.Task[None] | None = None

    def closed(self) -> None:
        """Something that held memory (a socket, a request) has closed."""
        self._last_close = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._release_when_quiet(), name="kvchat-heap-release")

    async def _release_when_quiet(self) -> None:
        while True:
            now = time.monotonic()
            due = max(self._last_close + self.quiet_s, self._last_release + self.min_interval_s)
            if now >= due:
                break
            await asyncio.sleep(due - now)
        self.releases += 1
        await asyncio.to_thread(self._release)
        self._last_release = time.monotonic()  # NOTE: the interval counts from the end (a thread starts late)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
