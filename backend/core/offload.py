"""CPU-bound backend work (rendering and tokenizing prompts, splitting messages, topic similarity), off the event
loop and one job at a time.

NOTE: one worker, not ``asyncio.to_thread``'s pool: this work is Python holding the GIL, so several threads would not
run it faster, and each would take the GIL from the event loop in turn. Measured with four 0.9 MiB prompts at once,
parallel threads stalled ``/livez`` up to 250 ms (p99); a single worker leaves the loop a GIL share it can count on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-cpu")


async def run_cpu(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` on the backend's CPU worker and wait for it without blocking the loop."""
    return await asyncio.get_running_loop().run_in_executor(_WORKER, functools.partial(fn, *args, **kwargs))
