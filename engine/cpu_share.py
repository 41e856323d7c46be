"""The engine's OpenMP width, step by step: the cores the rest of the machine leaves it.

Each of a step's ~150 parallel regions ends at a barrier, so a step on every core runs at the pace of its slowest
thread: while another process or thread (the chat backend's turns beside an engine in ``process`` mode or in the same
process, a neighbour) holds one of the cores, the thread that loses it stalls every region until the kernel's
scheduler gives it back. On a 2-core Zen 4, bf16, a step of a 26-token prompt and a decode row took 26 ms on 2
threads and 40 on 1 alone, but beside one busy process 64 ms p50 (212 max) on 2 threads and 43 (46) on 1; a batch
of 8 requests of 32 tokens beside one busy process 2.4 s at a fixed 2 threads, 0.9 s at the width chosen here
(``bench/cpu_share.py``, docs/benchmarks.md).

``CpuShare.apply`` runs before each step on the step thread. Every ``window_s`` it reads the busy time of the
process's CPUs (``/proc/stat``: everything but idle and iowait, steal included: a neighbour VM's) and the step
thread's own CPU time, counts the cores the others used (busy - own x width), and sets the width to the cores they
leave (``decide``): fewer at once, more again only after ``RAISE_AFTER`` windows in a row that say so.

NOTE: exactness: the width never changes a bit of a forward pass where ``kernels.same_bits_at_any_width`` holds (our
C kernels split outputs between threads, never one output's sum); elsewhere (AMX's dense-copy GEMMs, torch
fallbacks) the engine keeps its width fixed. Linux only (``/proc/stat``); elsewhere the width stays fixed too.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW_S = 0.2  # how often the width is reconsidered (/proc/stat counts in 10 ms ticks: 40 ticks on 2 cores)
RAISE_AFTER = 2  # windows in a row that leave more cores before the width grows (a width that drops acts at once)
_IDLE_FIELDS = (3, 4)  # idle, iowait in a /proc/stat "cpuN" line (after the label)


@dataclass(frozen=True, slots=True)
class Window:
    """What one window saw: its wall time, the machine's busy core-seconds, and the engine's own."""

    wall_s: float
    busy_s: float
    own_s: float

    def others(self) -> float:
        """Cores the rest of the machine used on average (never below 0: the tick counts are coarse)."""
        return max(0.0, (self.busy_s - self.own_s) / self.wall_s) if self.wall_s > 0 else 0.0


def decide(cores: int, most: int, current: int, others: float, votes: int) -> tuple[int, int]:
    """The next width and the count of windows in a row that asked for more: the cores ``others`` leave (a core
    counts as left while others use less than half of it), between 1 and ``most``."""
    want = max(1, min(most, math.floor(cores - others + 0.5)))
    if want < current:
        return want, 0
    if want > current:
        return (want, 0) if votes + 1 >= RAISE_AFTER else (current, votes + 1)
    return current, 0


def machine_busy_s(path: str = "/proc/stat", cpus: frozenset[int] | None = None) -> float | None:
    """Core-seconds the CPUs ``cpus`` (this process's affinity by default: in a container with a cpuset, its cores,
    not the host's) have been busy since boot; None where ``/proc/stat`` cannot be read."""
    cpus = frozenset(os.sched_getaffinity(0)) if cpus is None else cpus
    busy, seen = 0, False
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if not fields or not fields[0].startswith("cpu"):
                    break  # (the per-CPU lines come first, after the total)
                if not fields[0][3:].isdigit() or int(fields[0][3:]) not in cpus:
                    continue
                ticks = [int(v) for v in fields[1:9]]
                busy += sum(v for i, v in enumerate(ticks) if i not in _IDLE_FIELDS)
                seen = True
    except (OSError, ValueError):
        return None
    return busy / os.sysconf("SC_CLK_TCK") if seen else None


class CpuShare:
    """Chooses the step's width (``apply``, on the step thread) from the windows it measures."""

    def __init__(
        self,
        most: int,
        cores: int,
        *,
        window_s: float = WINDOW_S,
        busy: Callable[[], float | None] = machine_busy_s,
        own: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most = max(1, most)
        self.cores = max(1, cores)
        self.width = self.most
        self.changes = 0
        self._window_s = window_s
        self._busy, self._own, self._clock = busy, own, clock
        self._votes = 0
        self._start: tuple[float, float, float] | None = None

    @classmethod
    def for_engine(cls, threads: int, same_bits: bool) -> CpuShare | None:
        """The engine's, for ``threads`` torch threads; None where the width must stay fixed (a width that would
        change bits, one thread, no ``/proc/stat``)."""
        cpus = frozenset(os.sched_getaffinity(0))
        if not same_bits or threads <= 1 or machine_busy_s(cpus=cpus) is None:
            return None
        return cls(threads, len(cpus), busy=functools.partial(machine_busy_s, cpus=cpus))

    def observe(self) -> Window | None:
        """Close the window when it has lasted ``window_s`` (None before, or where the busy time cannot be read).
        Between windows a step costs one clock read: ``/proc/stat`` is read only when a window closes."""
        now = self._clock()
        if self._start is not None and now - self._start[0] < self._window_s:
            return None
        busy = self._busy()
        if busy is None:
            return None
        own = self._own()
        if self._start is None:
            self._start = (now, busy, own)
            return None
        t0, b0, o0 = self._start
        self._start = (now, busy, own)
        return Window(now - t0, busy - b0, (own - o0) * self.width)

    def apply(self) -> int:
        """The width for the step about to run, set as torch's (and so the C kernels') thread count."""
        window = self.observe()
        if window is not None:
            width, self._votes = decide(self.cores, self.most, self.width, window.others(), self._votes)
            if width != self.width:
                log.debug("engine width %d -> %d (others used %.2f cores)", self.width, width, window.others())
                self.width = width
                self.changes += 1
        import torch

        if torch.get_num_threads() != self.width:
            torch.set_num_threads(self.width)
        return self.width
