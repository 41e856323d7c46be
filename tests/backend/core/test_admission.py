"""``Admission``: counts up to the capacity it is given, refuses past it, and never goes below zero."""

from __future__ import annotations

from backend.core.admission import Admission


def test_admission_refuses_past_the_capacity_until_one_leaves() -> None:
    admission = Admission()
    assert [admission.try_enter(2) for _ in range(3)] == [True, True, False]
    admission.leave()
    assert admission.try_enter(2) is True
    assert admission.try_enter(3) is True  # the capacity is the caller's (the engine's, read per request)
    for _ in range(5):
        admission.leave()
    assert admission.admitted == 0
