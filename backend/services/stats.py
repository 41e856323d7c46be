"""What a tenant's admin sees of the service: its own replies (hit rate, TTFT, tokens/s), its sessions by status,
its topic shifts and cache invalidations over the window, and the engine's shared capacity (batch, queue, KV memory
held by requests, the KV cache by tier), which says how loaded the server is.

NOTE: nothing here depends on another tenant's cached tokens: hit rates are the tenant's own; the tier figures are
byte totals over every tenant's namespace, like the batch and queue sizes (a tenant can learn how full the server is,
never whether a given text is cached for someone else).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.metrics import Metrics, ReplySummary
from backend.db.models import ChatSession, InvalidationEvent, TopicHistory, utcnow
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient


@dataclass(frozen=True, slots=True)
class TierUsage:
    """The KV cache by tier, all tenants together, in bytes.

    NOTE: bytes only: block counters (cached, promoted, demoted) change with whether another tenant's prompt hit the
    cache, a probe a tenant must not have (tests/reliability/test_cache_isolation.py); the operator sees them on
    ``/metrics``.
    """

    memory_bytes: int  # blocks held by requests plus free blocks kept for reuse
    disk_bytes: int


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    running: int
    waiting: int
    kv_bytes_capacity: int
    kv_bytes_used: int  # held by requests in flight
    tiers: TierUsage


@dataclass(frozen=True, slots=True)
class ContextEvents:
    """What the context layer did for the tenant over a window: topic shifts seen, invalidations recorded."""

    topic_shifts: int
    invalidations: int


@dataclass(frozen=True, slots=True)
class TenantStats:
    replies: ReplySummary
    sessions_by_status: dict[str, int]
    topic_shifts: int
    invalidations: int
    engine: EngineCapacity


async def engine_capacity(engine: EngineClient) -> EngineCapacity:
    s = await control.stats(engine)
    block_bytes = engine.info.block_size * engine.info.kv_bytes_per_token
    tiers = TierUsage(
        memory_bytes=(s.kv.num_used_blocks + s.kv.num_evictable_blocks) * block_bytes, disk_bytes=s.tiers.disk_bytes
    )
    return EngineCapacity(
        running=s.running,
        waiting=s.waiting,
        kv_bytes_capacity=s.kv.num_blocks * block_bytes,
        kv_bytes_used=s.kv.num_used_blocks * block_bytes,
        tiers=tiers,
    )


async def tenant_stats(
    db: AsyncSession, engine: EngineClient, metrics: Metrics, tenant_id: str, window_s: float
) -> TenantStats:
    rows = await db.execute(
        select(ChatSession.status, func.count()).where(ChatSession.tenant_id == tenant_id).group_by(ChatSession.status)
    )
    events = await context_events(db, tenant_id, window_s)
    return TenantStats(
        replies=metrics.recent.summary(tenant_id, window_s),
        sessions_by_status={status: count for status, count in rows.all()},
        topic_shifts=events.topic_shifts,
        invalidations=events.invalidations,
        engine=await engine_capacity(engine),
    )


async def context_events(db: AsyncSession, tenant_id: str, window_s: float) -> ContextEvents:
    """The tenant's topic shifts and invalidation events of the last ``window_s`` seconds.

    NOTE: a deleted session's topic history goes with it (its invalidation events stay, with no session), so shifts
    count only the sessions that still exist.
    """
    since = utcnow() - timedelta(seconds=window_s)
    shifts = await db.scalar(
        select(func.count())
        .select_from(TopicHistory)
        .join(ChatSession, ChatSession.id == TopicHistory.session_id)
        .where(ChatSession.tenant_id == tenant_id, TopicHistory.shift.is_(True), TopicHistory.created_at >= since)
    )
    invalidations = await db.scalar(
        select(func.count())
        .select_from(InvalidationEvent)
        .where(InvalidationEvent.tenant_id == tenant_id, InvalidationEvent.created_at >= since)
    )
    return ContextEvents(topic_shifts=shifts or 0, invalidations=invalidations or 0)
