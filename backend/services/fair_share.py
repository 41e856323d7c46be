"""The tenants' fair-share settings in the database: weight and quotas (``backend/core/tenant_quota.py``). No row
means the defaults (weight 1, no limits). The operator sets them; every process loads them into its ``QuotaGate``
at start and then every ``REFRESH_S``, and the process that saved a change applies it at once."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import TenantNotFoundError
from backend.core.tenant_quota import DEFAULT_QUOTA, QuotaGate, TenantQuota
from backend.db.models import Tenant, TenantFairShare

REFRESH_S = 5.0  # NOTE: how soon another worker sees an operator's change; one small indexed read per period


def _quota(row: TenantFairShare) -> TenantQuota:
    return TenantQuota(row.weight, row.tokens_per_minute, row.max_concurrent)


async def load_all(db: AsyncSession) -> dict[str, TenantQuota]:
    """Every tenant's quota that is not the default, by tenant id."""
    rows = (await db.execute(select(TenantFairShare))).scalars()
    return {row.tenant_id: _quota(row) for row in rows}


async def load(db: AsyncSession, tenant_id: str) -> TenantQuota:
    """The tenant's quota (the defaults without a row); ``TenantNotFoundError`` for an unknown tenant."""
    if await db.get(Tenant, tenant_id) is None:
        raise TenantNotFoundError(f"no tenant {tenant_id!r}")
    row = await db.get(TenantFairShare, tenant_id)
    return DEFAULT_QUOTA if row is None else _quota(row)


async def save(db: AsyncSession, gate: QuotaGate, tenant_id: str, quota: TenantQuota) -> TenantQuota:
    """Store the tenant's weight and quotas and apply them in this process now."""
    if await db.get(Tenant, tenant_id) is None:
        raise TenantNotFoundError(f"no tenant {tenant_id!r}")
    row = await db.get(TenantFairShare, tenant_id)
    values = {"weight": quota.weight, "tokens_per_minute": quota.tokens_per_minute}
    values["max_concurrent"] = quota.max_concurrent
    if row is None:
        db.add(TenantFairShare(tenant_id=tenant_id, **values))
    else:
        for name, value in values.items():
            setattr(row, name, value)
    await db.commit()
    gate.set(tenant_id, quota)
    return quota


async def reset(db: AsyncSession, gate: QuotaGate, tenant_id: str) -> TenantQuota:
    """Back to the defaults (weight 1, no limits)."""
    if await db.get(Tenant, tenant_id) is None:
        raise TenantNotFoundError(f"no tenant {tenant_id!r}")
    await db.execute(delete(TenantFairShare).where(TenantFairShare.tenant_id == tenant_id))
    await db.commit()
    gate.set(tenant_id, None)
    return DEFAULT_QUOTA
