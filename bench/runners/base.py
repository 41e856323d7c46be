"""What every runner implements, and the typed values that pass between a runner and the driver.

A runner serves one turn at a time per call, but many calls may be in flight at once (one per session); a system
that cannot batch (HF transformers, llama-cpp-python) queues them, and that queueing is part of its TTFT.
"""

from __future__ import annotations

import resource
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.workload import ChatMessage

OnTokens = Callable[[int], None]  # called with the number of new tokens each time some arrive


@dataclass(frozen=True, slots=True)
class TurnRequest:
    session_id: str
    tenant: str
    turn_index: int
    messages: list[ChatMessage]
    prompt_ids: list[int]  # the same ids for every system: kvchat's tokenizer and chat template
    max_tokens: int


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """What the system itself says about a turn (timings are taken by the driver)."""

    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens reused from a cache; None when the system cannot tell
    output_tokens: int
    kv_bytes: int | None = None  # KV memory in use right after the turn, when the system can tell


@dataclass(slots=True)
class RunnerInfo:
    system: str
    version: str
    details: dict[str, Any] = field(default_factory=dict)


class RunnerUnavailable(RuntimeError):
    """The system cannot run here (not installed, failed to start); the message says why."""


class Runner(ABC):
    """One system under test. ``start`` → many concurrent ``run_turn`` → ``end_session`` per session → ``close``."""

    name: str = "runner"

    @abstractmethod
    async def start(self) -> RunnerInfo: ...

    @abstractmethod
    async def run_turn(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome: ...

    async def end_session(self, session_id: str) -> None:  # noqa: B027 - optional hook
        """The session is over (free what only it used, if the system keeps per-session state)."""

    @abstractmethod
    async def close(self) -> None: ...

    def kv_bytes(self) -> int | None:
        """KV memory in use now (sampled by the driver), or None when the system cannot tell."""
        return None

    def kv_capacity_bytes(self) -> int | None:
        """KV memory reserved up front (a preallocated pool), or None."""
        return None

    def peak_rss_bytes(self) -> int:
        """Peak resident memory of the process that holds the model (this one, unless a worker does)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
