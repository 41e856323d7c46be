"""What each engine replica did with one cache-control call an operator reads as an action (erase, flush, invalidate,
pin), so that a replica that did nothing is named instead of hiding in a sum of zeros.

A kvchat replica does the action (``DONE``) or fails (``FAILED``: unreachable, or an error answer). A vLLM replica
has no per-session or per-namespace control (``UNSUPPORTED``), except, for an erasure and where its server exposes
it, a reset of its whole prefix cache (``CACHE_RESET``: done, coarsely; the tenant chooses it, ``ReplicaErase``).

The in-process engine has no replicas: it reaches its whole cache, and its results carry no report (``report_of``
answers an empty, complete one). ``RemoteEngine`` returns the engine's result types with the report attached
(``ReportedErasure``, ``ReportedInvalidation``, ``ReportedPin``), so the ``EngineClient`` interface is unchanged; the
coarse erase is a capability of its own (``PrefixCacheReset``), which only an engine with such replicas has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from backend.engine_client.values import ErasureResult, InvalidationResult, PinResult


class ReplicaOutcome(StrEnum):
    DONE = "done"  # a kvchat replica did exactly what was asked
    CACHE_RESET = "cache_reset"  # a vLLM replica's whole prefix cache was reset instead (every session on it)
    UNSUPPORTED = "unsupported"  # the replica has no such action (vLLM): nothing was done there
    FAILED = "failed"  # the replica could not be reached, or answered an error: what it did is unknown


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    replica: str  # its URL
    outcome: ReplicaOutcome
    detail: str = ""  # why, in a few words, when it is not DONE

    @property
    def done(self) -> bool:
        return self.outcome in (ReplicaOutcome.DONE, ReplicaOutcome.CACHE_RESET)

    def describe(self) -> str:
        return f"{self.replica} ({self.outcome.value}: {self.detail})" if self.detail else self.replica


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One result per replica, in the order the replicas are listed (none: the in-process engine)."""

    results: tuple[ReplicaResult, ...] = ()

    @property
    def gaps(self) -> tuple[ReplicaResult, ...]:
        """The replicas where the action was not done."""
        return tuple(r for r in self.results if not r.done)

    @property
    def complete(self) -> bool:
        return not self.gaps

    def with_outcome(self, outcome: ReplicaOutcome) -> tuple[str, ...]:
        return tuple(r.replica for r in self.results if r.outcome is outcome)

    def replaced(self, changed: ReplicaReport) -> ReplicaReport:
        """This report with ``changed``'s results in place of the same replicas' (e.g. after a cache reset)."""
        by_url = {r.replica: r for r in changed.results}
        return ReplicaReport(tuple(by_url.get(r.replica, r) for r in self.results))

    def describe(self, what: str) -> str:
        """The gaps in a few words, for an audit row: ``not erased on http://a (unsupported: ...)``; ``""`` if none."""
        return f"not {what} on " + "; ".join(r.describe() for r in self.gaps) if self.gaps else ""


NO_REPLICAS = ReplicaReport()


# NOTE: subclasses of the engine's results, so the interface keeps the engine's return types; a subclass of a
# slots dataclass adds only its own slot, and ``report_of`` reads it without an isinstance chain at the callers.
@dataclass(frozen=True, slots=True)
class ReportedErasure(ErasureResult):
    replicas: ReplicaReport = field(default=NO_REPLICAS)


@dataclass(frozen=True, slots=True)
class ReportedInvalidation(InvalidationResult):
    replicas: ReplicaReport = field(default=NO_REPLICAS)


@dataclass(frozen=True, slots=True)
class ReportedPin(PinResult):
    replicas: ReplicaReport = field(default=NO_REPLICAS)


def report_of(result: ErasureResult | InvalidationResult | PinResult) -> ReplicaReport:
    """The per-replica report of a cache-control result: a remote engine's, or an empty one (the in-process engine)."""
    if isinstance(result, ReportedErasure | ReportedInvalidation | ReportedPin):
        return result.replicas
    return NO_REPLICAS


@runtime_checkable
class PrefixCacheReset(Protocol):
    """An engine whose replicas can reset their whole prefix cache (``RemoteEngine``; the in-process engine erases
    per session and needs no such thing)."""

    def reset_prefix_caches(self, replicas: Sequence[str]) -> ReplicaReport: ...
