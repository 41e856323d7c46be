"""CPU-bound backend work (rendering and tokenizing prompts, splitting messages, topic similarity), off the event
loop, fair across tenants.

``run_cpu(owner, fn, ...)`` queues ``fn`` behind the owner's (a tenant's) earlier jobs. A bounded pool of worker
threads serves the owners in turn: each worker takes the next owner in line, runs one of its jobs, and puts the owner
back at the end of the line if it has more. An owner never has two jobs running at once, so one tenant's slow message
holds at most one worker, and the other tenants' turns go on the other workers meanwhile.

NOTE: why a small pool of threads, not one worker and not ``asyncio.to_thread``'s pool. One worker runs jobs in
arrival order, so a tenant's slow message delayed every tenant queued behind it (issue 28: 11.7 s). Many threads
would each take the GIL from the event loop in turn: with four 0.9 MiB prompts tokenized in parallel threads,
``/livez`` stalled up to 250 ms (p99). The slow parts that remain, RE2 matching and the tokenizer's encoding, run
without the GIL; ``bench/hardening.py`` (its fairness part) measures the delay one tenant's hostile message adds
to another's turn.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger("kvchat.offload")
P = ParamSpec("P")
T = TypeVar("T")

WORKERS = 3
"""Threads of the shared pool: enough that two owners with slow jobs still leave one for everyone else."""

SHARED = ""
"""The owner of work that belongs to no tenant."""


@dataclass(slots=True)
class _Job:
    call: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


class FairExecutor:
    """Worker threads serving one FIFO queue per owner, owners in turn, at most one running job per owner."""

    def __init__(self, workers: int, name: str = "kvchat-cpu") -> None:
        if workers < 1:
            raise ValueError("a FairExecutor needs at least one worker")
        self._workers = workers
        self._name = name
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Job]] = {}  # owners with a job queued or running
        self._line: deque[str] = deque()  # owners with a job queued and none running, in turn order
        self._threads: list[threading.Thread] = []

    def submit(self, owner: str, call: Callable[[], T]) -> Future[T]:
        """Queue ``call`` behind the owner's earlier jobs; cancelling the future before it starts skips it."""
        job = _Job(call)
        with self._cond:
            self._start_threads()
            queue = self._queues.get(owner)
            if queue is None:
                self._queues[owner] = deque([job])
                self._line.append(owner)
                self._cond.notify()
            else:
                queue.append(job)  # NOTE: the owner is in line already, or its running job puts it back
        return job.future

    def submit_if_idle(self, owner: str, call: Callable[[], T]) -> Future[T] | None:
        """``submit`` when the owner has no job queued or running, else nothing (None): for spare work."""
        with self._cond:
            if owner in self._queues:
                return None
            return self.submit(owner, call)  # (the condition's lock is reentrant)

    def queued(self) -> dict[str, int]:
        """Jobs queued or running, per owner (for tests and metrics)."""
        with self._cond:
            return {owner: len(queue) for owner, queue in self._queues.items()}

    def _start_threads(self) -> None:
        while len(self._threads) < self._workers:
            thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._line:
                    self._cond.wait()
                owner = self._line.popleft()
                job = self._queues[owner][0]
            done: tuple[bool, Any] | None = None  # (ran, its result or error); None: cancelled before it started
            if job.future.set_running_or_notify_cancel():
                try:
                    done = (True, job.call())
                except BaseException as exc:  # noqa: BLE001 (handed to the caller, who raises it)
                    done = (False, exc)
            with self._cond:
                queue = self._queues[owner]
                queue.popleft()
                if queue:
                    self._line.append(owner)  # NOTE: at the end of the line: the owners take turns
                    self._cond.notify()
                else:
                    del self._queues[owner]
            # NOTE: the owner is let go first, so a caller that got its result finds it idle (``submit_if_idle``)
            if done is not None:
                ok, value = done
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)


_POOL = FairExecutor(WORKERS)


async def run_cpu(owner: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` on the shared pool, after the earlier jobs of ``owner`` (a tenant id, or ``SHARED``), and wait for
    it without blocking the loop. Cancelling the wait before the job starts drops the job.

    NOTE: ``fn`` runs in a copy of the caller's context (as ``asyncio.to_thread`` does), so what it logs carries the
    caller's request and session ids (``backend.core.logs``)."""
    return await asyncio.wrap_future(_POOL.submit(owner, _in_callers_context(fn, *args, **kwargs)))


def spare_cpu(owner: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T] | None:
    """Start ``fn`` on the shared pool only when ``owner`` has no job queued or running there (None otherwise), and
    do not wait for it: for work done ahead whose result lands in a cache, which the owner's own jobs would do anyway
    (under load it would only queue ahead of them). A failure is logged, not raised."""
    future = _POOL.submit_if_idle(owner, _in_callers_context(fn, *args, **kwargs))
    if future is not None:
        future.add_done_callback(_log_failure)
    return future


def _log_failure(future: Future[Any]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("a background CPU job failed: %r", exc)


def _in_callers_context(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Callable[[], T]:
    return functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
