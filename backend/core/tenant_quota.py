"""A tenant's fair share at the edge: its weight in the engine's fair scheduler and its optional quotas, checked in
memory before any engine work for a request.

    weight             the tenant's share of the engine while others are backlogged (engine/fair_share.py); 1 default
    tokens_per_minute  tokens the engine computed for the tenant (prompt tokens prefilled + completion tokens; a
                       prefix-cache hit is free) over the last 60 s; a request is refused while they reach the limit
    max_concurrent     requests of the tenant in flight in this process (chat turns and /v1 completions)

A refusal is ``RateLimited``: a websocket ``error`` frame ``rate_limited`` with ``retry_after_ms``, or HTTP 429 with
``Retry-After``. Nothing is stored or tokenized for a refused request.

NOTE: the counts are per process (like the /v1 admission): with N workers a tenant may use up to N times its limits.
A request's tokens count when it finishes, so a burst that starts under the limit may end over it; the next request
then waits until enough of the window has passed. Both keep the check a dictionary lookup on the event loop.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NoReturn

from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    DEFAULT_SHARE,
    EngineBusy,
    FairShare,
    GenerationEvent,
    Prompt,
    RequestFinished,
    RequestStats,
    SamplingParams,
)

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class TenantQuota:
    weight: float = 1.0
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight!r}")
        for name in ("tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value!r}")


DEFAULT_QUOTA = TenantQuota()


class RateLimited(EngineBusy):
    """A tenant over one of its quotas (``reason``: ``tokens_per_minute`` or ``max_concurrent``).

    NOTE: an ``EngineBusy``, so every path that refuses a busy request (nothing stored, the client retries after
    ``retry_after_s``) refuses this one the same way; the boundaries give it its own code and HTTP status.
    """

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason


class QuotaGate:
    """The tenants' quotas as last loaded, and their use in this process. Used on the event loop only."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
        on_served: Callable[[str, RequestStats], None] | None = None,
    ) -> None:
        self._clock = clock
        self._on_refused = on_refused  # (tenant id, reason): the per-tenant refusal counter
        self.on_served = on_served  # (tenant id, a finished request's stats): the per-tenant served tokens, queue time
        self._quotas: dict[str, TenantQuota] = {}
        self._in_flight: dict[str, int] = {}
        self._served: dict[str, deque[tuple[float, int]]] = {}  # (finished at, tokens), oldest first

    def load(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Replace every tenant's quota (a tenant not named gets the defaults); forget the use that aged out."""
        self._quotas = dict(quotas)
        now = self._clock()
        for tenant in list(self._served):
            self._window(tenant, now)

    def set(self, tenant_id: str, quota: TenantQuota | None) -> None:
        """One tenant's quota changed here (None: back to the defaults); other processes see it at their next load."""
        if quota is None or quota == DEFAULT_QUOTA:
            self._quotas.pop(tenant_id, None)
        else:
            self._quotas[tenant_id] = quota

    def quota(self, tenant_id: str) -> TenantQuota:
        return self._quotas.get(tenant_id, DEFAULT_QUOTA)

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight.get(tenant_id, 0)

    def tokens_in_window(self, tenant_id: str) -> int:
        return sum(n for _, n in self._window(tenant_id, self._clock()))

    def admit(self, tenant_id: str) -> FairShare:
        """Count one more request of ``tenant_id`` in flight, or raise ``RateLimited``. Returns its engine share."""
        quota = self.quota(tenant_id)
        in_flight = self._in_flight.get(tenant_id, 0)
        if quota.max_concurrent is not None and in_flight >= quota.max_concurrent:
            # NOTE: when one finishes is unknown; a second is the engine's own busy hint
            self._refuse(tenant_id, "max_concurrent", f"{in_flight} requests of this tenant are in flight", 1.0)
        if quota.tokens_per_minute is not None:
            now = self._clock()
            window = self._window(tenant_id, now)
            used = sum(n for _, n in window)
            if used >= quota.tokens_per_minute:
                wait = _until_under(window, used, quota.tokens_per_minute, now)
                message = f"{used} tokens in the last minute (limit {quota.tokens_per_minute})"
                self._refuse(tenant_id, "tokens_per_minute", message, wait)
        self._in_flight[tenant_id] = in_flight + 1
        return FairShare(tenant_id, quota.weight)

    def release(self, tenant_id: str, tokens: int) -> None:
        """A request admitted by ``admit`` ended, after the engine computed ``tokens`` for it."""
        left = self._in_flight.get(tenant_id, 0) - 1
        if left > 0:
            self._in_flight[tenant_id] = left
        else:
            self._in_flight.pop(tenant_id, None)
        if tokens > 0:
            self._served.setdefault(tenant_id, deque()).append((self._clock(), tokens))

    def _window(self, tenant_id: str, now: float) -> deque[tuple[float, int]]:
        window = self._served.get(tenant_id)
        if window is None:
            return deque()
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        if not window:
            del self._served[tenant_id]
        return window

    def _refuse(self, tenant_id: str, reason: str, message: str, retry_after_s: float) -> NoReturn:
        if self._on_refused is not None:
            self._on_refused(tenant_id, reason)
        raise RateLimited(f"rate limited: {message}", retry_after_s, reason)


def _until_under(window: deque[tuple[float, int]], used: int, limit: int, now: float) -> float:
    """Seconds until enough of ``window`` ages out that its tokens fall under ``limit``."""
    for at, tokens in window:
        used -= tokens
        if used < limit:
            return max(0.001, at + WINDOW_S - now)
    return WINDOW_S  # (unreachable: the window's own tokens reach the limit)


def computed_tokens(event: RequestFinished) -> int:
    """What a finished request cost the engine: prompt tokens it prefilled (not the cached ones) + completion."""
    return event.stats.prefilled_tokens + event.stats.completion_tokens


async def gated(
    gate: QuotaGate, tenant_id: str, open_stream: Callable[[FairShare], AsyncGenerator[GenerationEvent, None]]
) -> AsyncGenerator[GenerationEvent, None]:
    """The engine stream ``open_stream(share)`` opens, admitted by ``gate`` first (``RateLimited`` from the first
    step, before the engine sees the request) and released, with the tokens it cost, when it ends.

    NOTE: no await between the check and the engine's first step, so the caller's abort-after-cancel reasoning
    (``backend/chat/reply_stream.py``) holds through this wrapper.
    """
    share = gate.admit(tenant_id)
    tokens = 0
    try:
        async with aclosing(open_stream(share)) as stream:
            async for event in stream:
                if isinstance(event, RequestFinished):
                    tokens = computed_tokens(event)
                    if gate.on_served is not None:
                        gate.on_served(tenant_id, event.stats)
                yield event
    finally:
        gate.release(tenant_id, tokens)


class GatedEngine:
    """An ``EngineClient`` whose ``generate`` goes through the tenants' quotas: a request that names its tenant
    (``share=FairShare(tenant_id)``) is admitted by ``gate`` (or refused with ``RateLimited``) and reaches the engine
    with the tenant's weight. A request without a tenant, and every other call, passes through unchanged.

    NOTE: delegation by ``__getattr__`` rather than a method per call: the interface may grow (cache control,
    erasure) without this class having to follow (mypy counts ``__getattr__`` towards the protocol).
    """

    def __init__(self, inner: EngineClient, gate: QuotaGate) -> None:
        self._inner = inner
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> AsyncGenerator[GenerationEvent, None]:
        if share.tenant == DEFAULT_SHARE.tenant:
            return self._inner.generate(prompt, params, namespace, request_id, session, share)

        def open_stream(weighted: FairShare) -> AsyncGenerator[GenerationEvent, None]:
            return self._inner.generate(prompt, params, namespace, request_id, session, weighted)

        return gated(self.gate, share.tenant, open_stream)
