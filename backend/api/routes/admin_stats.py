"""Admin: the tenant's live figures (the operations dashboard polls this)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from backend.api.deps import AdminDep, DbDep, StateDep
from backend.services import stats

router = APIRouter(prefix="/admin/stats", tags=["admin: stats"])


class RepliesOut(BaseModel):
    window_s: float
    replies: int
    hit_rate: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tokens_per_s: float


class TiersOut(BaseModel):
    """The KV cache by tier, every tenant together: bytes only. The block counters (cached, promoted, demoted...) move
    with whether another tenant's prompt was cached, so they are the operator's (``/metrics``), never a tenant's."""

    memory_bytes: int = Field(description="memory tier: blocks held by requests plus free blocks kept for reuse")
    disk_bytes: int = Field(description="disk tier: bytes of K/V stored")


class EngineOut(BaseModel):
    running: int
    waiting: int
    kv_bytes_capacity: int
    kv_bytes_used: int
    tiers: TiersOut


class StatsOut(BaseModel):
    replies: RepliesOut
    sessions_by_status: dict[str, int]
    topic_shifts: int = Field(description="customer messages that started a new topic, over the window")
    invalidations: int = Field(description="invalidation events (cached context freed), over the window")
    engine: EngineOut


@router.get("", response_model=StatsOut)
async def get_stats(
    tenant: AdminDep,
    db: DbDep,
    state: StateDep,
    window_s: Annotated[
        float, Query(gt=0, le=86_400, description="the window of the reply, topic-shift and invalidation figures")
    ] = 300.0,
) -> StatsOut:
    """The tenant's replies, topic shifts and invalidations over the last ``window_s`` seconds, its sessions by
    status, and engine capacity."""
    s = await stats.tenant_stats(db, state.engine, state.metrics, tenant.id, window_s)
    return StatsOut.model_validate(s, from_attributes=True)
