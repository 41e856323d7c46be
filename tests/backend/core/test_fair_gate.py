"""``FairGate``: at most ``capacity`` holders, work-conserving, freed slots to the waiting owner holding the fewest,
and no slot lost to a cancelled waiter or a failing block. Pure asyncio, no database.

The tests that a plain FIFO semaphore (``asyncio.Semaphore``) fails are marked ``FIFO fails``."""

from __future__ import annotations

import asyncio

import pytest

from backend.core.fair_gate import FairGate

pytestmark = pytest.mark.anyio


class Holders:
    """Tasks that each hold a slot of ``gate`` until told to leave; ``entered`` lists who got in, in order."""

    def __init__(self, gate: FairGate) -> None:
        self.gate = gate
        self.entered: list[str] = []
        self.leave: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, owner: str, name: str) -> asyncio.Task[None]:
        self.leave[name] = asyncio.Event()
        task = asyncio.create_task(self._hold(owner, name), name=name)
        self.tasks[name] = task
        return task

    async def _hold(self, owner: str, name: str) -> None:
        async with self.gate.hold(owner):
            self.entered.append(name)
            await self.leave[name].wait()

    async def release(self, name: str) -> None:
        self.leave[name].set()
        await self.tasks[name]
        await _settle()


def assert_empty(gate: FairGate) -> None:
    """No slot held and nobody waiting: every slot came back."""
    assert gate.held() == {}
    assert gate.waiting() == {}


async def _settle() -> None:
    """Let every ready task run until it waits again."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_capacity_is_honoured() -> None:
    gate = FairGate(3)
    holders = Holders(gate)
    assert not gate.full
    for i in range(5):
        holders.start(f"t{i}", f"t{i}")
    await _settle()
    assert gate.full
    assert holders.entered == ["t0", "t1", "t2"]
    assert gate.held() == {"t0": 1, "t1": 1, "t2": 1}
    assert gate.waiting() == {"t3": 1, "t4": 1}
    await holders.release("t1")
    assert holders.entered == ["t0", "t1", "t2", "t3"]
    for name in ("t0", "t2", "t3", "t4"):
        await holders.release(name)
    assert not gate.full
    assert_empty(gate)


async def test_a_lone_owner_takes_every_slot_at_once() -> None:
    gate = FairGate(4)
    holders = Holders(gate)
    for i in range(4):
        holders.start("a", f"a{i}")
    await _settle()
    assert holders.entered == ["a0", "a1", "a2", "a3"]
    assert gate.held() == {"a": 4}
    assert gate.waiting() == {}
    for i in range(4):
        await holders.release(f"a{i}")
    assert gate.held() == {}


async def test_a_newcomer_gets_the_next_freed_slot_before_a_bursts_queue() -> None:
    # FIFO fails: a semaphore gives the freed slot to a4, the longest waiting, and b0 waits behind all 20 of A's.
    gate = FairGate(4)
    holders = Holders(gate)
    for i in range(24):
        holders.start("a", f"a{i}")
    await _settle()
    assert gate.held() == {"a": 4}
    assert gate.waiting() == {"a": 20}
    holders.start("b", "b0")
    await _settle()
    assert gate.waiting() == {"a": 20, "b": 1}
    await holders.release("a0")
    assert holders.entered[4:] == ["b0"]
    assert gate.held() == {"a": 3, "b": 1}
    await holders.release("a1")  # (only A waits)
    assert holders.entered[5:] == ["a4"]
    assert gate.held() == {"a": 3, "b": 1}
    await holders.release("b0")
    assert holders.entered[6:] == ["a5"]
    for name in [f"a{i}" for i in range(2, 24)]:
        await holders.release(name)
    assert_empty(gate)


async def test_a_freed_slot_goes_to_the_waiting_owner_holding_fewest() -> None:
    # FIFO fails: a semaphore lets the waiters in in arrival order, a1 a2 b0 b1 c0.
    gate = FairGate(2)
    holders = Holders(gate)
    holders.start("a", "a0")
    holders.start("b", "bx")
    await _settle()
    for name in ("a1", "a2"):
        holders.start("a", name)
    for name in ("b0", "b1"):
        holders.start("b", name)
    holders.start("c", "c0")
    await _settle()
    await holders.release("bx")  # held: a 1, b 1 (the freed slot still counted), c 0
    assert holders.entered[2:] == ["c0"]
    await holders.release("a0")  # held: a 1 (counted), b 0, c 1
    assert holders.entered[3:] == ["b0"]
    await holders.release("c0")  # held: a 0, b 1
    assert holders.entered[4:] == ["a1"]
    await holders.release("b0")  # held: a 1, b 1 (counted): a tie, and b waited longer (a was served since)
    assert holders.entered[5:] == ["b1"]
    await holders.release("a1")
    assert holders.entered[6:] == ["a2"]
    for name in ("b1", "a2"):
        await holders.release(name)
    assert gate.held() == {}


async def test_owners_holding_as_few_take_turns_the_longest_waiting_first() -> None:
    # FIFO fails: a semaphore lets in b1 second, before c0 (with one slot, as the chat test does).
    gate = FairGate(1)
    holders = Holders(gate)
    holders.start("x", "x0")
    await _settle()
    for owner, name in (("b", "b0"), ("b", "b1"), ("c", "c0")):
        holders.start(owner, name)
    await _settle()
    await holders.release("x0")  # b and c hold none: b waited longest
    assert holders.entered == ["x0", "b0"]
    await holders.release("b0")  # b's freed slot counts as b's: c holds fewer
    assert holders.entered == ["x0", "b0", "c0"]
    await holders.release("c0")
    await holders.release("b1")
    assert holders.entered == ["x0", "b0", "c0", "b1"]
    assert_empty(gate)


async def test_a_waiter_cancelled_before_its_grant_leaks_no_slot() -> None:
    gate = FairGate(1)
    holders = Holders(gate)
    holders.start("a", "a0")
    await _settle()
    cancelled = holders.start("b", "b0")
    holders.start("c", "c0")
    await _settle()
    cancelled.cancel()
    await _settle()
    assert cancelled.cancelled()
    assert gate.waiting() == {"c": 1}
    await holders.release("a0")
    assert holders.entered == ["a0", "c0"]
    await holders.release("c0")
    assert_empty(gate)


async def test_a_waiter_cancelled_after_its_grant_before_it_ran_passes_the_slot_on() -> None:
    gate = FairGate(1)
    holders = Holders(gate)
    async with gate.hold("a"):
        granted = holders.start("b", "b0")
        holders.start("c", "c0")
        await _settle()
    # NOTE: no await since the block left: the slot is b0's now, but b0's task has not run yet
    assert gate.held() == {"b": 1}
    granted.cancel()
    await _settle()
    assert granted.cancelled()
    assert holders.entered == ["c0"]
    assert gate.held() == {"c": 1}
    await holders.release("c0")
    assert_empty(gate)


async def test_a_cancelled_waiter_whose_task_has_not_run_is_skipped() -> None:
    gate = FairGate(1)
    holders = Holders(gate)
    async with gate.hold("a"):
        cancelled = holders.start("b", "b0")
        holders.start("b", "b1")
        await _settle()
        cancelled.cancel()  # NOTE: its future is cancelled now; its task forgets it only when it runs, after the grant
    assert gate.held() == {"b": 1}
    await _settle()
    assert cancelled.cancelled()
    assert holders.entered == ["b1"]
    await holders.release("b1")
    assert_empty(gate)


async def test_an_exception_in_the_block_releases_the_slot() -> None:
    gate = FairGate(1)
    with pytest.raises(RuntimeError, match="boom"):
        async with gate.hold("a"):
            raise RuntimeError("boom")
    assert gate.held() == {}
    async with gate.hold("b"):
        assert gate.held() == {"b": 1}


async def test_an_exception_hands_the_slot_to_the_next_waiter() -> None:
    gate = FairGate(1)
    holders = Holders(gate)

    async def failing() -> None:
        async with gate.hold("a"):
            await asyncio.sleep(0)
            raise RuntimeError("boom")

    task = asyncio.create_task(failing())
    await _settle()
    holders.start("b", "b0")
    await _settle()
    with pytest.raises(RuntimeError, match="boom"):
        await task
    await _settle()
    assert holders.entered == ["b0"]
    await holders.release("b0")
    assert gate.held() == {}


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairGate(0)
