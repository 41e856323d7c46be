"""A turn's marks: each step stamped once, reported in path order from the frame taken."""

from __future__ import annotations

from backend.chat.turn_marks import TurnMarks


def test_each_step_is_stamped_once_and_reported_after_received() -> None:
    marks = TurnMarks(received=100.0)
    marks.stored = 100.002
    marks.mark("started")
    first = marks.started
    marks.mark("started")  # (a tool turn's second request keeps the first stamp)
    assert marks.started == first
    steps = marks.steps_ms()
    assert list(steps) == ["stored", "started"]
    assert steps["stored"] == 2.0


def test_steps_not_reached_are_left_out() -> None:
    assert TurnMarks(received=5.0).steps_ms() == {}
