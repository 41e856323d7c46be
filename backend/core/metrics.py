"""Prometheus metrics of one app: the engine's (vLLM-style ``kvchat:`` names) and the backend's.

Engine gauges and counters are read from ``EngineClient.stats()`` when ``/metrics`` is scraped (nothing to keep in
step), or, for an engine behind the network, from a snapshot refreshed in the background (a scrape never waits on a
replica); latency histograms are observed as replies stream. Each app owns its registry, so several apps in one process
(tests) never collide. NOTE: no label ever carries a user or session identifier: a label value per customer would
grow the series without bound and leak who uses the service. The fair-share series (``kvchat:tenant_*``) are the one
exception, by tenant id: tenants are created by the operator (bounded), their ids are opaque, and per-tenant served
tokens, queue time and refusals are what an operator needs to see that the shares and quotas hold.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.engine_client import control
from backend.engine_client.control import StatsSnapshot
from backend.engine_client.engine_metrics import CONTENT_TYPE as CONTENT_TYPE  # (re-exported: /metrics)
from backend.engine_client.engine_metrics import EngineCollector, read_in_place
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import RequestStats

# Buckets of vLLM's TTFT / inter-token histograms (seconds), which dashboards built for vLLM expect.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DB_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The app's registry and the metrics observed as requests run."""

    def __init__(self, engine: EngineClient | None = None) -> None:
        self.registry = CollectorRegistry()
        if engine is not None:
            self.watch_engine(engine)
        r = self.registry
        self.ttft = Histogram(
            "kvchat:time_to_first_token_seconds", "Arrival to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kvchat:inter_token_latency_seconds", "Time between streamed deltas.", buckets=_ITL_BUCKETS, registry=r
        )
        self.open_sockets = Gauge("kvchat:ws_open_sockets", "Open chat websockets.", registry=r)
        self.messages = Counter("kvchat:chat_messages", "Chat messages stored, by role.", ["role"], registry=r)
        self.errors = Counter("kvchat:errors", "Errors answered to clients, by stable code.", ["code"], registry=r)
        self.topic_shifts = Counter("kvchat:topic_shifts", "Topic shifts detected in chat sessions.", registry=r)
        self.contacts_blocked = Counter(
            "kvchat:contacts_blocked",
            "URLs, e-mail addresses and phone numbers left out of replies (not in their grounding), by kind.",
            ["kind"],
            registry=r,
        )
        self.fanout_frames = Counter(
            "kvchat:fanout_frames_heard",
            "Chat frames heard from the other workers (of the sessions this worker's sockets follow only).",
            registry=r,
        )
        self.db_latency = Histogram(
            "kvchat:db_query_duration_seconds", "Database statement latency.", buckets=_DB_BUCKETS, registry=r
        )
        self.tenant_served = Counter(
            "kvchat:tenant_served_tokens",
            "Tokens the engine computed per tenant (prompt tokens prefilled + completion tokens), by kind.",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queue = Histogram(
            "kvchat:tenant_queue_seconds",
            "Time a tenant's requests waited in the engine before they were first scheduled.",
            ["tenant"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tenant_refusals = Counter(
            "kvchat:tenant_refusals",
            "Requests refused by the tenant's quota, by reason.",
            ["tenant", "reason"],
            registry=r,
        )

        self.recent = RecentReplies()

    def watch_engine(self, engine: EngineClient) -> StatsSnapshot | None:
        """Expose the engine's gauges and counters: read at scrape time, or, when its control calls wait on the
        network, from the snapshot returned here (the caller starts and stops its refresh)."""
        if not control.blocks(engine):
            self.registry.register(EngineCollector(read_in_place(engine)))
            return None
        snapshot = StatsSnapshot(engine)
        self.registry.register(EngineCollector(snapshot.read))
        return snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reply_timer(self, tenant_id: str) -> ReplyTimer:
        return ReplyTimer(self, tenant_id)

    def tenant_served_request(self, tenant_id: str, stats: RequestStats) -> None:
        """A tenant's request finished (``backend/core/tenant_quota.QuotaGate.on_served``)."""
        self.tenant_served.labels(tenant_id, "prompt").inc(stats.prefilled_tokens)
        self.tenant_served.labels(tenant_id, "completion").inc(stats.completion_tokens)
        self.tenant_queue.labels(tenant_id).observe(stats.queue_s)

    def tenant_refused(self, tenant_id: str, reason: str) -> None:
        """A tenant's request was refused by its quota (``QuotaGate.on_refused``)."""
        self.tenant_refusals.labels(tenant_id, reason).inc()


@dataclass(frozen=True, slots=True)
class ReplySample:
    at: float  # time.monotonic() when the reply finished
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ReplySummary:
    """A tenant's replies over a recent window (what the dashboard charts)."""

    window_s: float
    replies: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tokens_per_s: float  # completion tokens per second of the window


class RecentReplies:
    """The last replies of each tenant, kept in memory (bounded), for tenant-scoped figures.

    NOTE: per tenant, never across tenants: a tenant admin sees its own hit rate and latency, and nothing that
    depends on another tenant's cached tokens. Prometheus keeps the server-wide series (without tenant labels).
    """

    def __init__(self, per_tenant: int = 2000) -> None:
        self._per_tenant = per_tenant
        self._samples: dict[str, deque[ReplySample]] = {}

    def record(self, tenant_id: str, stats: RequestStats) -> None:
        samples = self._samples.setdefault(tenant_id, deque(maxlen=self._per_tenant))
        samples.append(
            ReplySample(
                time.monotonic(), stats.ttft_s, stats.prompt_tokens, stats.cached_tokens, stats.completion_tokens
            )
        )

    def summary(self, tenant_id: str, window_s: float = 300.0) -> ReplySummary:
        since = time.monotonic() - window_s
        recent = [s for s in self._samples.get(tenant_id, ()) if s.at >= since]
        prompt = sum(s.prompt_tokens for s in recent)
        ttfts = sorted(s.ttft_s for s in recent)
        return ReplySummary(
            window_s=window_s,
            replies=len(recent),
            hit_rate=sum(s.cached_tokens for s in recent) / prompt if prompt else 0.0,
            ttft_p50_ms=_quantile(ttfts, 0.50) * 1000 if ttfts else None,
            ttft_p99_ms=_quantile(ttfts, 0.99) * 1000 if ttfts else None,
            tokens_per_s=sum(s.completion_tokens for s in recent) / window_s,
        )


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of a sorted, non-empty list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class ReplyTimer:
    """Observes one streamed reply: the gap between deltas (inter-token latency) and, at the end, its TTFT."""

    def __init__(self, metrics: Metrics, tenant_id: str) -> None:
        self._metrics = metrics
        self._tenant_id = tenant_id
        self._last: float | None = None

    def delta(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            self._metrics.itl.observe(now - self._last)
        self._last = now

    def finished(self, stats: RequestStats) -> None:
        self._metrics.ttft.observe(stats.ttft_s)
        self._metrics.recent.record(self._tenant_id, stats)


def instrument_database(db_engine: AsyncEngine, metrics: Metrics) -> None:
    """Time every statement the app runs (``kvchat:db_query_duration_seconds``)."""

    def before(conn: object, _cursor: object, _stmt: object, _params: object, _ctx: object, _many: object) -> None:
        conn.info.setdefault("kvchat_started", []).append(time.perf_counter())  # type: ignore[attr-defined]

    def after(conn: object, _cursor: object, _stmt: object, _params: object, _ctx: object, _many: object) -> None:
        started = conn.info.get("kvchat_started")  # type: ignore[attr-defined]
        if started:
            metrics.db_latency.observe(time.perf_counter() - started.pop())

    event.listen(db_engine.sync_engine, "before_cursor_execute", before)
    event.listen(db_engine.sync_engine, "after_cursor_execute", after)
