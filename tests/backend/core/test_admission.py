"""``Admission``: counts up to the capacity it is given, refuses past it, and never goes below zero; the admitted
requests start ``MAX_STARTING`` at a time, each giving its slot back once handed off (or ended)."""

from __future__ import annotations

import asyncio

import pytest

from backend.core import admission as admission_module
from backend.core.admission import MAX_STARTING, Admission


def test_admission_refuses_past_the_capacity_until_one_leaves() -> None:
    admission = Admission(capacity=2)
    assert [admission.try_enter() for _ in range(3)] == [True, True, False]
    admission.leave()
    assert admission.try_enter() is True
    assert admission.try_enter() is False
    for _ in range(5):
        admission.leave()
    assert admission.admitted == 0


async def _hold_slot(admission: Admission, entered: list[int], n: int, started: asyncio.Event) -> None:
    async with admission.start_slot():
        entered.append(n)
        await started.wait()
        admission_module.started()  # (the request is handed off: its slot goes to the next one)
        await asyncio.sleep(3600)  # (the request goes on, but holds no slot)


@pytest.mark.anyio
async def test_admitted_requests_start_a_few_at_a_time_until_each_is_handed_off() -> None:
    admission = Admission(capacity=100)
    entered: list[int] = []
    started = asyncio.Event()
    tasks = [asyncio.create_task(_hold_slot(admission, entered, n, started)) for n in range(MAX_STARTING + 3)]
    await asyncio.sleep(0.01)
    assert entered == list(range(MAX_STARTING))  # the others wait for a slot
    started.set()
    await asyncio.sleep(0.01)
    assert entered == list(range(MAX_STARTING + 3))  # handed off: the slots went to the waiting ones
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert admission.starting._value == MAX_STARTING  # every slot came back, none twice


@pytest.mark.anyio
async def test_a_request_that_ends_before_it_is_handed_off_gives_its_slot_back() -> None:
    admission = Admission(capacity=1)
    for _ in range(MAX_STARTING + 1):
        async with admission.start_slot():
            pass
    admission_module.started()  # (outside a request: nothing to release)
    assert admission.starting._value == MAX_STARTING
