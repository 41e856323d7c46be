"""Where a server's start is: its phase, for ``/livez``, ``/readyz`` and one log line per phase.

``kvchat serve`` listens before the slow part of a start (a first start converts the model for about a minute), so a
user or an orchestrator can see what is happening: ``/livez`` names the phase, ``/readyz`` stays 503 until the phase
is ``ready``, and the chat and API answer a ``starting`` error meanwhile (``StartingError``), never a hang.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum

from sqlalchemy.exc import SQLAlchemyError

from backend.engine_client.values import EngineError

log = logging.getLogger("kvchat")

# What a start can fail with for a reason the operator can fix (a model, a database, a disk, a setting): reported on
# one line. Anything else is a bug, logged with its traceback.
STARTUP_ERRORS = (EngineError, SQLAlchemyError, OSError, ValueError)


class Phase(StrEnum):
    STARTING = "starting"  # the process is up; the start has not begun its first step
    MIGRATING = "migrating"  # alembic upgrade head
    CONVERTING_MODEL = "converting model"  # a GGUF's first start: dequantized once into a safetensors cache
    LOADING_MODEL = "loading model"  # weights into memory, kernels built for this CPU, the step loop started
    RECOVERING = "recovering"  # replies a crash cut off are marked incomplete; pinned prefixes are computed
    READY = "ready"
    FAILED = "failed"


@dataclass(slots=True)
class Startup:
    """The phase of one start; ``enter`` logs one line per phase with the seconds since the start began."""

    phase: Phase = Phase.STARTING
    error: str | None = None  # why the start failed (``Phase.FAILED``), on one line
    started_at: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def enter(self, phase: Phase, what: str) -> None:
        self.phase = phase
        log.info("start %.1fs: %s", self.elapsed_s, what)

    def fail(self, reason: str) -> None:
        self.phase, self.error = Phase.FAILED, reason
        log.error("start %.1fs: failed: %s", self.elapsed_s, reason)
