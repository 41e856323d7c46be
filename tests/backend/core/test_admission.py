"""``Admission``: counts up to the capacity it is given, refuses past it, and never goes below zero."""

from __future__ import annotations

from backend.core.admission import Admission


def test_admission_refuses_past_the_capacity_until_one_leaves() -> None:
    admission = Admission(capacity=2)
    assert [admission.try_enter() for _ in range(3)] == [True, True, False]
    admission.leave()
    assert admission.try_enter() is True
    assert admission.try_enter() is False
    for _ in range(5):
        admission.leave()
    assert admission.admitted == 0
