"""The engine's control calls as coroutines (``backend/engine_client/control.py``): a replica that does not answer
holds its caller only until the deadline and never blocks the event loop; the metrics read a snapshot."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from backend.engine_client import control
from backend.engine_client.remote import RemoteEngine
from backend.engine_client.remote_errors import EngineUnreachable
from backend.engine_client.values import EngineStopped
from backend.engine_client.wire import encode
from engine.llm_engine import LLMEngine
from support.fake_replica import FakeReplica

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


# ---------------------------------------------------------------- the calls that free or write cache, on a thread

DEADLINE_S = 0.3
CLIENT_TIMEOUT_S = 3.0  # the remote client's own timeout: the deadline, not this, must end each call


@pytest.fixture(scope="module")
def silent_replica(tiny_engine: LLMEngine) -> Iterator[FakeReplica]:
    info = {"engine": "kvchat", "model": "kvchat/tiny", "info": encode(tiny_engine.info), "prompt_limit": 2048}
    fake = FakeReplica(info)
    yield fake
    fake.stop()


@pytest.fixture
async def unanswering(
    silent_replica: FakeReplica, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RemoteEngine]:
    """A remote engine whose replica started fine and now answers no control call."""
    engine = RemoteEngine(silent_replica.url, model=str(tiny_model_dir), timeout_s=CLIENT_TIMEOUT_S, retries=0)
    await engine.start()
    silent_replica.silent_control = True
    monkeypatch.setattr(control, "TIMEOUT_S", DEADLINE_S)
    yield engine
    silent_replica.silent_control = False
    await engine.stop()


_CALLS: dict[str, Callable[[RemoteEngine], Awaitable[object]]] = {
    "release_session": lambda e: control.release_session(e, "s1"),
    "erase_session": lambda e: control.erase_session(e, "s1", "ns"),
    "invalidate": lambda e: control.invalidate(e, "ns", session="s1", from_position=0, reason="flushed"),
    "invalidate_prefix": lambda e: control.invalidate_prefix(e, "ns", [1, 2, 3], 0, "handbook_edited"),
    "flush_namespace": lambda e: control.flush_namespace(e, "ns", "admin_flush"),
    "configure_cache": lambda e: control.configure_cache(e, memory_ttl_s=60.0),
    "reset_prefix_caches": lambda e: control.threaded(e, e.reset_prefix_caches, [e.url]),
}


@pytest.mark.parametrize("name", list(_CALLS))
async def test_a_replica_that_does_not_answer_is_unreachable_at_the_deadline(
    unanswering: RemoteEngine, name: str
) -> None:
    began = time.monotonic()
    with pytest.raises(EngineUnreachable, match=rf"did not answer {name} within 0\.3 s"):
        await _CALLS[name](unanswering)
    assert time.monotonic() - began < CLIENT_TIMEOUT_S  # (ended by the deadline, not by the client giving up)


async def test_an_in_process_engine_frees_on_a_thread_without_a_deadline(tiny_engine: LLMEngine) -> None:
    assert await control.release_session(tiny_engine, "no-such-session") == 0
    freed = await control.invalidate(tiny_engine, "ns", session="no-such-session", from_position=0, reason="flushed")
    assert (freed.blocks_freed, freed.tokens_freed) == (0, 0)
