"""The step thread's events reach the loop in order, a burst with one wake-up, and a closed loop drops them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from engine.loop_bridge import LoopBridge


@pytest.mark.anyio
async def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up() -> None:
    loop = asyncio.get_running_loop()
    wakes = 0
    real = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any) -> Any:
        nonlocal wakes
        wakes += 1
        return real(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        bridge = LoopBridge(loop)
        a: asyncio.Queue[int] = asyncio.Queue()
        b: asyncio.Queue[int] = asyncio.Queue()
        # NOTE: the loop is not running callbacks while the thread puts (this coroutine does not await): one burst
        thread = threading.Thread(target=lambda: [bridge.put(a if i % 2 else b, i) for i in range(100)])
        thread.start()
        thread.join()
        assert wakes == 1
        await asyncio.sleep(0)
        assert [a.get_nowait() for _ in range(50)] == list(range(1, 100, 2))
        assert [b.get_nowait() for _ in range(50)] == list(range(0, 100, 2))
        bridge.put(a, 7)  # (the list was flushed: the next put wakes the loop again)
        assert wakes == 2
        await asyncio.sleep(0)
        assert a.get_nowait() == 7
    finally:
        del loop.call_soon_threadsafe


def test_a_closed_loop_drops_the_items_without_raising() -> None:
    loop = asyncio.new_event_loop()
    bridge = LoopBridge(loop)
    loop.close()
    queue: asyncio.Queue[int] = asyncio.Queue()
    bridge.put(queue, 1)
    bridge.put(queue, 2)  # (nothing is left pending to block the next wake-up)
    assert queue.empty()
