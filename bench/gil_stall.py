"""Engine step time beside a Python thread that holds the GIL, at the default and at the step loop's switch interval.

The forward pass hands the GIL back around each torch op; a busy event loop (a flood of streams) then delays each
retake by up to ``sys.getswitchinterval()``. This drives 32 greedy requests (24 tokens each) through the engine on the
calling thread, with and without a spinning pure-Python thread, at 5 ms and at ``engine.gil``'s interval::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.gil_stall
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

from engine.config import EngineConfig
from engine.gil import STEP_LOOP_SWITCH_INTERVAL_S
from engine.llm_engine import LLMEngine
from engine.request_table import Collector
from engine.sampling_params import SamplingParams


def run_batch(llm: LLMEngine, label: str) -> list[float]:
    """Seconds of each step of one batch of 32 requests."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sink = Collector()
    for i in range(32):
        llm.submit(f"Question {i} {label}: what is your return policy for orders shipped abroad?", params, "ns", sink)
    times: list[float] = []
    while True:
        start = time.perf_counter()
        if not llm.core.step():
            return times
        times.append(time.perf_counter() - start)


def main() -> int:
    llm = LLMEngine(EngineConfig(model="smollm2"))
    llm.load()
    busy = threading.Event()

    def spin() -> None:
        while True:
            busy.wait()
            sum(i * i for i in range(10_000))  # pure Python: holds the GIL but for the interval's requests

    threading.Thread(target=spin, daemon=True).start()
    run_batch(llm, "warm-up")
    for interval in (0.005, STEP_LOOP_SWITCH_INTERVAL_S):
        sys.setswitchinterval(interval)
        for spinning in (False, True):
            (busy.set if spinning else busy.clear)()
            times = run_batch(llm, f"{interval}-{spinning}")
            print(
                f"switch interval {interval * 1000:.1f} ms, busy Python thread {spinning}: first step (prefill) "
                f"{times[0] * 1000:.0f} ms, decode step median {statistics.median(times[1:]) * 1000:.1f} ms, "
                f"{len(times)} steps in {sum(times) * 1000:.0f} ms",
                flush=True,
            )
    busy.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
