"""engine.gil: the switch interval is only lowered. What a shorter one buys (a step's wait beside a thread that runs
Python) is measured by ``bench/gil_stall.py``, not timed here."""

from __future__ import annotations

import sys
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
