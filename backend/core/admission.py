"""Admission of ``/v1`` completions: how many are running in this process, refused in memory past the engine's
capacity.

``AdmissionGuard`` (``backend/api/boundary.py``) counts a request from its first byte to its last, so a burst beyond
what the engine can queue (``max_num_seqs`` running + ``max_waiting``) is refused with a 503 at once, before it is
parsed, authenticated or tokenized (400 streams at once: the last refusal took 3.5 s before). The engine's own check
stays: chat turns share the engine and are not counted here, so with the engine full of them a ``/v1`` request is
still refused by the engine, after tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY_AFTER_S = 1.0  # the engine's own hint when its queue is full (engine.scheduler.SchedulerConfig.retry_after_s)


@dataclass(slots=True)
class Admission:
    """Requests admitted and not finished, up to ``capacity`` (the engine's: set when the app starts, from the
    engine's configuration). Used on the event loop only."""

    capacity: int
    admitted: int = 0

    def try_enter(self) -> bool:
        """Count one more request, or refuse (False) when ``capacity`` are in already."""
        if self.admitted >= self.capacity:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted = max(0, self.admitted - 1)
