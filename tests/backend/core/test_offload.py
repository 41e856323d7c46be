"""The fair CPU pool: an owner's jobs run one at a time and in order, owners take turns, a slow owner holds one worker
and no more, a job cancelled before it starts never runs, and errors reach the caller."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from backend.core import logs
from backend.core.offload import SHARED, FairExecutor, run_cpu

WAIT_S = 10.0  # only ever reached when a test fails: every wait below ends on an event


def _blocker() -> tuple[threading.Event, threading.Event, Callable[[], str]]:
    """A job that says it started, then waits until released."""
    started, release = threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        assert release.wait(WAIT_S)
        return "slow"

    return started, release, job


def test_owners_take_turns_and_each_owner_keeps_its_order() -> None:
    pool = FairExecutor(workers=1)
    started, release, slow = _blocker()
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str) -> Callable[[], None]:
        def job() -> None:
            with lock:
                order.append(name)

        return job

    first = pool.submit("a", slow)
    assert started.wait(WAIT_S)
    futures = [pool.submit(owner, record(f"{owner}{n}")) for owner, n in [("a", 2), ("a", 3), ("b", 1), ("c", 1)]]
    assert pool.queued() == {"a": 3, "b": 1, "c": 1}
    release.set()
    assert first.result(WAIT_S) == "slow"
    for future in futures:
        future.result(WAIT_S)
    assert order == ["b1", "c1", "a2", "a3"]  # a went to the back of the line after its first job
    assert pool.queued() == {}


def test_a_slow_owner_holds_one_worker_and_the_others_go_on() -> None:
    pool = FairExecutor(workers=2)
    started, release, slow = _blocker()
    hostile = [pool.submit("hostile", slow), pool.submit("hostile", lambda: "second")]
    assert started.wait(WAIT_S)
    others = [pool.submit(f"tenant{i}", lambda i=i: i) for i in range(5)]  # type: ignore[misc]
    assert [f.result(WAIT_S) for f in others] == [0, 1, 2, 3, 4]  # while the hostile job still runs
    assert not hostile[1].done()  # its own second job waits behind it: never two at once per owner
    release.set()
    assert [f.result(WAIT_S) for f in hostile] == ["slow", "second"]


def test_a_job_cancelled_before_it_starts_never_runs() -> None:
    pool = FairExecutor(workers=1)
    started, release, slow = _blocker()
    ran: list[str] = []
    pool.submit(SHARED, slow)
    assert started.wait(WAIT_S)
    skipped = pool.submit(SHARED, lambda: ran.append("skipped"))
    after = pool.submit(SHARED, lambda: ran.append("after"))
    assert skipped.cancel()
    release.set()
    after.result(WAIT_S)
    assert ran == ["after"]


def test_an_error_reaches_the_caller_and_the_worker_goes_on() -> None:
    pool = FairExecutor(workers=1)

    def fail() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        pool.submit("a", fail).result(WAIT_S)
    assert pool.submit("a", lambda: 7).result(WAIT_S) == 7


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        FairExecutor(workers=0)


def test_run_cpu_runs_off_the_loop_thread_with_arguments() -> None:
    def where(a: int, *, b: int) -> tuple[str, int]:
        return threading.current_thread().name, a + b

    name, total = asyncio.run(run_cpu("tenant", where, 2, b=3))
    assert name.startswith("kvchat-cpu-") and total == 5


def test_a_job_sees_the_callers_log_ids() -> None:
    async def from_a_turn() -> str | None:
        logs.session_id.set("sess-7")  # (in this task's context: what a chat socket sets once it knows its session)
        return await run_cpu("tenant-a", logs.session_id.get)

    assert asyncio.run(from_a_turn()) == "sess-7"  # what the job logs carries the session, as the turn itself does
    assert asyncio.run(run_cpu("tenant-a", logs.session_id.get)) is None  # only the caller's: nothing leaks across


def test_spare_work_starts_only_while_its_owner_has_no_job() -> None:
    pool = FairExecutor(2)
    started, release, slow = _blocker()
    busy = pool.submit("a", slow)
    assert started.wait(WAIT_S)
    assert pool.submit_if_idle("a", lambda: "spare") is None  # (a's own job runs: the spare one would queue)
    spare = pool.submit_if_idle("b", lambda: "spare")  # b has nothing: it runs
    assert spare is not None and spare.result(WAIT_S) == "spare"
    release.set()
    assert busy.result(WAIT_S) == "slow"
    later = pool.submit_if_idle("a", lambda: "spare")
    assert later is not None and later.result(WAIT_S) == "spare"
