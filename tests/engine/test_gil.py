"""engine.gil: the switch interval is only lowered, and a shorter one bounds how long a thread that keeps handing the
GIL back (as the forward pass does around each torch op) waits beside a thread that runs Python."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from engine.gil import STEP_LOOP_SWITCH_INTERVAL_S, shorten_switch_interval


@pytest.fixture(autouse=True)
def _restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_lowers_the_interval_and_never_raises_it() -> None:
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval() == pytest.approx(STEP_LOOP_SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.0001)
    assert shorten_switch_interval() == pytest.approx(0.0001)


def _hand_backs_beside_a_busy_thread(interval_s: float, count: int = 60) -> float:
    """Seconds for ``count`` GIL hand-backs (``time.sleep(0)`` drops and retakes it) while a thread spins in Python."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        for _ in range(count):
            time.sleep(0)
        return time.perf_counter() - start
    finally:
        stop.set()
        thread.join()


def test_a_short_interval_bounds_the_wait_of_each_hand_back() -> None:
    slow = _hand_backs_beside_a_busy_thread(0.005)
    sys.setswitchinterval(0.005)
    shorten_switch_interval()
    fast = _hand_backs_beside_a_busy_thread(sys.getswitchinterval())
    # NOTE: ~5 ms vs ~0.5 ms a hand-back; a factor 3 leaves room for a loaded machine.
    assert fast < slow / 3, (fast, slow)
