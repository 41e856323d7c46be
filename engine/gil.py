"""A short GIL switch interval while the step loop shares its process with an event loop.

The forward pass releases the GIL inside each torch op and takes it back before the next one: a SmolLM2 step is a
few hundred such hand-backs. When another thread runs Python meanwhile (the server's event loop under a flood of
streams, the CPU offload workers), each hand-back waits until that thread is asked to drop the GIL: CPython asks
after ``sys.getswitchinterval()`` (5 ms by default). Measured on the AMX Xeon (2 cores;
``bench/gil_stall.py``): a 32-row decode step took 25 ms alone and 878 ms beside one pure-Python thread at
5 ms, 256 ms at 0.5 ms. So one tenant's flood of requests slowed every tenant's tokens, whatever the scheduler did.

NOTE: only ever lowered, never raised (a caller that set a shorter one knows better), and process-wide: the price is
more frequent GIL hand-overs between Python threads, a few microseconds each, only while two threads want it.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

STEP_LOOP_SWITCH_INTERVAL_S = 0.0005
"""The switch interval while the step loop runs beside other Python threads (see the module docstring)."""


def shorten_switch_interval(interval_s: float = STEP_LOOP_SWITCH_INTERVAL_S) -> float:
    """Lower the interpreter's GIL switch interval to ``interval_s`` unless it is shorter already; returns it."""
    current = sys.getswitchinterval()
    if interval_s < current:
        sys.setswitchinterval(interval_s)
        log.info("GIL switch interval %.2f ms -> %.2f ms (the engine's step loop)", current * 1000, interval_s * 1000)
    return sys.getswitchinterval()
