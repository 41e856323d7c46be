"""The server's long-lived heap is frozen out of the garbage collector while serving, and handed back after; what
serving frees is released once a run of closes is over."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from backend.core.heap import FreedMemoryReleaser, long_lived_heap_frozen, release_freed_memory


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_heap_is_frozen_inside_and_handed_back_after() -> None:
    dropped = _Node()
    gone = weakref.ref(dropped)
    del dropped  # garbage in a cycle: collected before the freeze, not frozen with the rest
    assert gc.get_freeze_count() == 0
    with long_lived_heap_frozen() as frozen:
        assert gone() is None
        assert frozen > 0 and gc.get_freeze_count() > 0  # (a frozen object freed by its refcount leaves the count)
        assert len(gc.get_objects()) < frozen  # a full collection no longer walks them
    assert gc.get_freeze_count() == 0


def test_garbage_made_while_serving_is_still_collected() -> None:
    with long_lived_heap_frozen():
        made = _Node()
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None


@pytest.mark.anyio
async def test_a_run_of_closes_releases_once_when_quiet_and_not_more_often_than_the_interval() -> None:
    released: list[float] = []
    releaser = FreedMemoryReleaser(quiet_s=0.05, min_interval_s=0.3, release=lambda: released.append(time.monotonic()))
    start = time.monotonic()
    for _ in range(20):  # a burst of closes, 10 ms apart
        releaser.closed()
        await asyncio.sleep(0.01)
    assert released == []  # (still closing: not quiet yet)
    await asyncio.sleep(0.15)
    assert len(released) == 1 and released[0] - start >= 0.2  # once, after the last close and its quiet time
    releaser.closed()
    await asyncio.sleep(0.1)
    assert len(released) == 1  # the next one waits for the interval
    await asyncio.sleep(0.35)
    assert len(released) == 2 and released[1] - released[0] >= 0.3
    await releaser.stop()


def test_releasing_freed_memory_collects_cycles() -> None:
    made = _Node()
    gone = weakref.ref(made)
    del made
    release_freed_memory()
    assert gone() is None
