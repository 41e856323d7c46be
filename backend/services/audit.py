"""The admin audit trail: one ``admin_audit`` row per admin write action, with its result.

Written by one dependency (``backend.api.deps.audited``) around every admin write route, in a session of its own, so
a request whose own transaction rolled back (an error) is still on record. Rows are read back per tenant, newest
first.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.db.models import AdminAudit

OK = "ok"
INCOMPLETE = "incomplete"  # done in part: e.g. an erasure that an engine replica could not do (the detail names it)
UNEXPECTED = "internal_error"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    tenant_id: str | None  # None: an operator action (engine-global), which belongs to no tenant
    actor: str  # the admin key's display prefix, or "operator"
    action: str  # e.g. "session.flush"
    target: str | None  # the path's ids (a session, a rule, a key), None for the tenant itself
    result: str  # OK, INCOMPLETE, or the error's stable code
    detail: str | None = None  # what the action did, when its route says (e.g. the blocks an erasure removed)


def result_of(exc: BaseException) -> str:
    """The stable code an error leaves with (``BackendError`` and the context layer's errors carry one)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else UNEXPECTED


async def record(sessionmaker: async_sessionmaker[AsyncSession], entry: AuditEntry) -> None:
    async with sessionmaker() as db:
        db.add(
            AdminAudit(
                tenant_id=entry.tenant_id,
                actor=entry.actor,
                action=entry.action,
                target=entry.target,
                result=entry.result,
                detail=entry.detail,
            )
        )
        await db.commit()


async def list_entries(db: AsyncSession, tenant_id: str | None, limit: int, offset: int) -> list[AdminAudit]:
    """The tenant's audit rows (``None``: the operator's), newest first."""
    owner = AdminAudit.tenant_id.is_(None) if tenant_id is None else AdminAudit.tenant_id == tenant_id
    rows = await db.execute(
        select(AdminAudit).where(owner).order_by(AdminAudit.at.desc(), AdminAudit.id.desc()).limit(limit).offset(offset)
    )
    return list(rows.scalars())
