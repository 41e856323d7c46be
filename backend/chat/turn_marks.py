"""When a turn reached each step of its path to the first shown token (``docs/turn_path.md``), reported with its
completion as ``usage.steps_ms`` so that a client, or ``bench.backend_overhead``, can tell where the time went.

Every mark is ``time.perf_counter()`` in the worker process; ``steps_ms`` gives each as milliseconds after
``received`` (the frame taken by the turn path), in path order. A step a turn did not reach (a stored reply
replayed, a turn cut off before its prompt) is left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass(slots=True)
class TurnMarks:
    received: float  # the user.message frame reached the turn path
    stored: float | None = None  # its transaction committed (the ack follows)
    started: float | None = None  # the turn's task began (after the session's turn before it)
    planned: float | None = None  # the worker thread's plan returned: the prompt is tokenized
    submitted: float | None = None  # the prompt went to the engine
    first_token: float | None = None  # the engine's first token reached the turn
    first_shown: float | None = None  # the first delta was published (the contact guard held what came before)

    def mark(self, step: str) -> None:
        """Stamp ``step`` now, once: a tool turn's later engine requests keep the first stamps."""
        if getattr(self, step) is None:
            setattr(self, step, time.perf_counter())

    def steps_ms(self) -> dict[str, float]:
        out = {}
        for f in fields(self)[1:]:
            t = getattr(self, f.name)
            if t is not None:
                out[f.name] = round((t - self.received) * 1000, 2)
        return out
