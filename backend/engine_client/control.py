"""The engine's control calls as coroutines with a deadline: what the backend awaits instead of calling
``EngineClient.stats``, ``session_footprint``, ``pin_prefix``, ``unpin`` and ``cache_settings`` in place, and
instead of sending ``release_session``, ``erase_session``, ``invalidate``, ``invalidate_prefix``, ``flush_namespace``,
``configure_cache`` and ``reset_prefix_caches`` to a thread of its own.

For the in-process engine these are bookkeeping in memory (microseconds): they run in place. For an engine behind the
network (``RemoteEngine``, which says so with ``control_blocks = True``) each is a round trip per replica, up to the
client's timeout for one that does not answer: they run on a worker thread, and the caller waits at most
``timeout_s``, so a slow or unreachable replica never blocks the event loop, and never holds a request longer than
the deadline (``EngineUnreachable`` then; the thread finishes on its own, bounded by the client's timeout).
The calls that free or write cache (``threaded``) run on a thread in both cases (an in-process engine's disk tier
writes files), with the deadline for a remote engine only.

``StatsSnapshot`` is the engine's stats as the metrics collector reads them: refreshed in the background, so a scrape
never waits on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from backend.engine_client.protocol import EngineClient
from backend.engine_client.remote_errors import EngineUnreachable
from backend.engine_client.values import (
    CacheFootprint,
    CacheSettings,
    EngineError,
    EngineInfo,
    EngineStats,
    ErasureResult,
    InvalidationResult,
    PinResult,
)

log = logging.getLogger("kvchat.engine_client")
T = TypeVar("T")

TIMEOUT_S = 5.0  # the longest a control call holds its caller (an admin request, a dashboard refresh)


def blocks(engine: EngineClient) -> bool:
    """Whether ``engine``'s control calls wait on the network (else they are quick enough to run in place)."""
    return bool(getattr(engine, "control_blocks", False))


async def call(engine: EngineClient, fn: Callable[..., T], *args: Any, timeout_s: float | None = None, **kw: Any) -> T:
    """``fn(*args, **kw)``, one of ``engine``'s control methods: in place, or on a thread within the deadline
    (``timeout_s``, else ``TIMEOUT_S``)."""
    if not blocks(engine):
        return fn(*args, **kw)
    return await _within(fn, args, kw, TIMEOUT_S if timeout_s is None else timeout_s)


async def threaded(engine: EngineClient, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)`` on a thread (it may write to disk, even in process); within ``TIMEOUT_S`` for an engine
    behind the network."""
    if not blocks(engine):
        return await asyncio.to_thread(functools.partial(fn, *args, **kw))
    return await _within(fn, args, kw, TIMEOUT_S)


async def _within(fn: Callable[..., T], args: tuple[Any, ...], kw: dict[str, Any], timeout_s: float) -> T:
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(functools.partial(fn, *args, **kw))
    except TimeoutError:
        name = getattr(fn, "__name__", "a control call")
        raise EngineUnreachable(f"the engine did not answer {name} within {timeout_s:g} s") from None


async def stats(engine: EngineClient) -> EngineStats:
    return await call(engine, engine.stats)


async def session_footprint(engine: EngineClient, session: str) -> CacheFootprint:
    return await call(engine, engine.session_footprint, session)


async def pin_prefix(engine: EngineClient, namespace: str, token_ids: Sequence[int]) -> PinResult:
    return await call(engine, engine.pin_prefix, namespace, token_ids)


async def unpin(engine: EngineClient, namespace: str) -> int:
    return await call(engine, engine.unpin, namespace)


async def cache_settings(engine: EngineClient) -> CacheSettings:
    return await call(engine, engine.cache_settings)


async def configure_cache(engine: EngineClient, **changes: object) -> CacheSettings:
    return await threaded(engine, engine.configure_cache, **changes)  # (a lower disk cap deletes files)


async def release_session(engine: EngineClient, session: str) -> int:
    return await threaded(engine, engine.release_session, session)  # (demoted to disk where there is a disk tier)


async def erase_session(engine: EngineClient, session: str, namespace: str) -> ErasureResult:
    return await threaded(engine, engine.erase_session, session, namespace)


async def invalidate(
    engine: EngineClient, namespace: str, *, session: str | None, from_position: int | None, reason: str
) -> InvalidationResult:
    return await threaded(
        engine, engine.invalidate, namespace, session=session, from_position=from_position, reason=reason
    )


async def invalidate_prefix(
    engine: EngineClient, namespace: str, token_ids: Sequence[int], from_position: int, reason: str
) -> InvalidationResult:
    return await threaded(engine, engine.invalidate_prefix, namespace, token_ids, from_position, reason)


async def flush_namespace(engine: EngineClient, namespace: str, reason: str) -> InvalidationResult:
    return await threaded(engine, engine.flush_namespace, namespace, reason)


class StatsSnapshot:
    """The engine's info and stats as of the last refresh (every ``period_s``, in the background), for the metrics
    collector: a scrape reads it and never waits on the engine. None until the first refresh, and after a refresh
    that failed (the engine is down: its gauges disappear rather than freeze at old values)."""

    def __init__(self, engine: EngineClient, period_s: float = 5.0) -> None:
        self._engine, self._period_s = engine, period_s
        self._now: tuple[EngineInfo, EngineStats] | None = None
        self._task: asyncio.Task[None] | None = None

    def read(self) -> tuple[EngineInfo, EngineStats] | None:
        return self._now

    async def refresh(self) -> None:
        try:
            self._now = (self._engine.info, await stats(self._engine)) if self._engine.is_running else None
        except EngineError as exc:
            log.debug("the engine's stats could not be read: %s", exc)
            self._now = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvchat-engine-stats")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._period_s)
