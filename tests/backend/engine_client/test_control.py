"""The engine's control calls as coroutines (``backend/engine_client/control.py``): a replica that does not answer
holds its caller only until the deadline and never blocks the event loop; the metrics read a snapshot."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backend.engine_client import control
from backend.engine_client.remote_errors import EngineUnreachable
from backend.engine_client.values import EngineStopped
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.anyio


class _SlowEngine:
    """An engine whose control calls wait on the network (``control_blocks``), for ``delay_s`` each."""

    control_blocks = True

    def __init__(self, inner: LLMEngine, delay_s: float) -> None:
        self.inner, self.delay_s, self.is_running, self.fail = inner, delay_s, True, False
        self.threads: set[str] = set()

    @property
    def info(self):  # type: ignore[no-untyped-def]
        return self.inner.info

    def stats(self):  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail:
            raise EngineStopped("down")
        return self.inner.stats()


async def test_a_silent_replica_costs_the_deadline_and_the_loop_keeps_running(tiny_engine: LLMEngine) -> None:
    slow = _SlowEngine(tiny_engine, delay_s=1.0)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    began = time.monotonic()
    with pytest.raises(EngineUnreachable, match=r"did not answer stats within 0\.2 s"):
        await control.call(slow, slow.stats, timeout_s=0.2)  # type: ignore[arg-type]
    waited = time.monotonic() - began
    ticker.cancel()
    assert 0.2 <= waited < 0.6
    assert ticks >= 10  # the loop ran while the call waited
    assert threading.main_thread().name not in slow.threads


async def test_an_in_process_engine_answers_in_place(tiny_engine: LLMEngine) -> None:
    assert not control.blocks(tiny_engine)
    assert await control.stats(tiny_engine) == tiny_engine.stats()


async def test_the_snapshot_is_what_the_last_refresh_read(tiny_engine: LLMEngine) -> None:
    slow = _SlowEngine(tiny_engine, delay_s=0.0)
    snapshot = control.StatsSnapshot(slow)  # type: ignore[arg-type]
    assert snapshot.read() is None
    await snapshot.refresh()
    now = snapshot.read()
    assert now is not None and now[0] == tiny_engine.info and now[1] == tiny_engine.stats()
    slow.fail = True
    await snapshot.refresh()
    assert snapshot.read() is None  # an engine that cannot be read shows no gauges, not stale ones
