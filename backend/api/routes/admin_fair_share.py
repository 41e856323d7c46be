"""Operator: a tenant's fair share — its weight in the engine's fair scheduler and its optional quotas (tokens per
minute, concurrent requests; ``backend/core/tenant_quota.py``). ``PUT`` replaces them (this process applies them at
once, the others within ``fair_share.REFRESH_S``), ``DELETE`` returns to the defaults (weight 1, no limits).

NOTE: operator only: a tenant that could set its own weight would take the others' share."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import DbDep, OperatorDep, StateDep, operator_audited
from backend.core.limits import Identifier
from backend.core.tenant_quota import TenantQuota
from backend.services import fair_share

router = APIRouter(prefix="/admin/fair-share", tags=["operator: fair share"])
_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "KVCHAT_OPERATOR_TOKEN is set and the request does not carry it"},
    403: {"description": "no KVCHAT_OPERATOR_TOKEN is set and the client is not on this machine"},
    404: {"description": "tenant_not_found"},
}


class FairShareIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(default=1.0, gt=0, le=1000, description="share of the engine while others are backlogged")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=10**12, description="tokens computed for the tenant per minute; null = no limit"
    )
    max_concurrent: int | None = Field(
        default=None, ge=1, le=1_000_000, description="requests in flight per process; null = no limit"
    )

    def quota(self) -> TenantQuota:
        return TenantQuota(self.weight, self.tokens_per_minute, self.max_concurrent)


class FairShareOut(FairShareIn):
    tenant_id: str

    @classmethod
    def of(cls, tenant_id: str, q: TenantQuota) -> FairShareOut:
        return cls(
            tenant_id=tenant_id, weight=q.weight, tokens_per_minute=q.tokens_per_minute, max_concurrent=q.max_concurrent
        )


@router.get("/{tenant_id}", response_model=FairShareOut, responses=_RESPONSES)
async def get_fair_share(tenant_id: Identifier, _: OperatorDep, db: DbDep) -> FairShareOut:
    """The tenant's weight and quotas as stored."""
    return FairShareOut.of(tenant_id, await fair_share.load(db, tenant_id))


@router.put(
    "/{tenant_id}",
    response_model=FairShareOut,
    dependencies=[operator_audited("tenant.fair_share")],
    responses=_RESPONSES,
)
async def set_fair_share(tenant_id: Identifier, body: FairShareIn, db: DbDep, state: StateDep) -> FairShareOut:
    """Replace the tenant's weight and quotas; the tenant's next request uses them."""
    return FairShareOut.of(tenant_id, await fair_share.save(db, state.quotas, tenant_id, body.quota()))


@router.delete(
    "/{tenant_id}",
    response_model=FairShareOut,
    dependencies=[operator_audited("tenant.fair_share.reset")],
    responses=_RESPONSES,
)
async def reset_fair_share(tenant_id: Identifier, db: DbDep, state: StateDep) -> FairShareOut:
    """Back to the defaults: weight 1, no limits."""
    return FairShareOut.of(tenant_id, await fair_share.reset(db, state.quotas, tenant_id))
