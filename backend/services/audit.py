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
UNEXPECTED = "internal_error"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    tenant_id: str
    actor: str  # the admin key's display prefix
    action: str  # e.g. "session.flush"
    target: str | None  # the path's ids (a session, a rule, a key), None for the tenant itself
    result: str  # OK, or the error's stable code


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
            )
        )
        await db.commit()


async def list_entries(db: AsyncSession, tenant_id: str, limit: int, offset: int) -> list[AdminAudit]:
    """The tenant's audit rows, newest first."""
    rows = await db.execute(
        select(AdminAudit)
        .where(AdminAudit.tenant_id == tenant_id)
        .order_by(AdminAudit.at.desc(), AdminAudit.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(rows.scalars())
