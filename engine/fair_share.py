"""Virtual token counters (VTC): whose request the scheduler serves next, by tenant and within a tenant by session.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Every key (a tenant; inside a tenant, a
session) has a counter that grows with the tokens the engine computes for it, divided by the key's weight. The
scheduler admits, and gives a step's prefill budget to, the backlogged key with the smallest counter. Properties:

* served tokens split by weight among keys that stay backlogged (the counters move together);
* a key that returns from idle is lifted to the smallest counter of the active keys (or, with none active, to the
  last such value: the virtual time), so idling banks no credit;
* work-conserving: the counters only order the keys that have work, a lone key gets everything;
* only computed tokens count: a prefix-cache hit costs nothing, so reuse stays cheap for whoever has it.

NOTE: counters are floats of tokens / weight: exact for integer token counts and weights that are powers of two, and
far from rounding trouble before 2**50 tokens. A counter of a key that left at or below the virtual time is dropped
(it would be lifted to the virtual time anyway), so memory follows the active keys, not every key ever seen.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.errors import InvalidRequestError

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class FairShare:
    """Who a request is charged to: its tenant, and the tenant's weight (a tenant of weight 2 gets twice the tokens
    of a tenant of weight 1 while both are backlogged)."""

    tenant: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:  # (also refuses NaN)
            raise InvalidRequestError(f"a fair-share weight must be > 0, got {self.weight!r}")


DEFAULT_SHARE = FairShare("")


class VirtualCounters(Generic[K]):
    """The counters of one set of keys, and which of them are active (hold a request in the scheduler)."""

    def __init__(self) -> None:
        self._counters: dict[K, float] = {}
        self._weights: dict[K, float] = {}
        self._active: dict[K, int] = {}  # key -> its requests in the scheduler (waiting or running)
        self._floor = 0.0  # the virtual time while no key is active

    def __len__(self) -> int:
        """Keys with a counter kept (the active ones and those that left above the virtual time)."""
        return len(self._counters)

    @property
    def virtual_time(self) -> float:
        """The smallest counter of the active keys; with none active, the last such value."""
        if self._active:
            self._floor = max(self._floor, min(self._counters[k] for k in self._active))
        return self._floor

    def counter(self, key: K) -> float:
        counter = self._counters.get(key)  # NOTE: not .get(key, self.virtual_time): that walks every active key
        return self.virtual_time if counter is None else counter

    def is_active(self, key: K) -> bool:
        return key in self._active

    @property
    def num_active(self) -> int:
        """Keys with a request in the scheduler."""
        return len(self._active)

    def enter(self, key: K, weight: float = 1.0) -> None:
        """A request of ``key`` joins. A key that was idle is lifted to the virtual time first."""
        self._weights[key] = weight
        if key not in self._active:
            self._counters[key] = max(self._counters.get(key, 0.0), self.virtual_time)
        self._active[key] = self._active.get(key, 0) + 1

    def leave(self, key: K) -> None:
        """A request of ``key`` left (finished). The last one makes the key idle."""
        left = self._active[key] - 1
        if left:
            self._active[key] = left
            return
        vt = self.virtual_time  # NOTE: taken while the key still counts, so its departure cannot lower it
        del self._active[key]
        for k in [k for k, c in self._counters.items() if k not in self._active and c <= vt]:
            del self._counters[k]
            del self._weights[k]

    def charge(self, key: K, tokens: int) -> None:
        """``tokens`` were computed for ``key`` (negative: a planned chunk was given back)."""
        self._counters[key] += tokens / self._weights[key]

    def weight(self, key: K) -> float:
        return self._weights.get(key, 1.0)


class FairCounters:
    """The two levels the scheduler ranks by: tenants, and inside each tenant its sessions (a request without a
    session is its own). ``rank`` orders requests; ``charge`` bills both levels."""

    def __init__(self) -> None:
        self.tenants: VirtualCounters[str] = VirtualCounters()
        self._sessions: dict[str, VirtualCounters[str]] = {}

    def enter(self, share: FairShare, session: str) -> None:
        self.tenants.enter(share.tenant, share.weight)
        self._sessions.setdefault(share.tenant, VirtualCounters()).enter(session)

    def leave(self, share: FairShare, session: str) -> None:
        self.tenants.leave(share.tenant)
        sessions = self._sessions[share.tenant]
        sessions.leave(session)
        if not self.tenants.is_active(share.tenant):  # NOTE: a tenant back from idle starts its sessions afresh
            del self._sessions[share.tenant]

    def charge(self, share: FairShare, session: str, tokens: int) -> None:
        self.tenants.charge(share.tenant, tokens)
        self._sessions[share.tenant].charge(session, tokens)

    def rank(self, share: FairShare, session: str) -> tuple[float, float]:
        """Smaller is served first: the tenant's counter, then the session's within the tenant."""
        return self.tenants.counter(share.tenant), self._sessions[share.tenant].counter(session)
