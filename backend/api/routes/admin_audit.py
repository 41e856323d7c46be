"""Admin: the tenant's audit trail (every admin write action: who, what, target, result, when), newest first."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from backend.api.deps import AdminDep, DbDep
from backend.core.limits import QueryOffset
from backend.db.models import AdminAudit
from backend.services import audit

router = APIRouter(prefix="/admin/audit", tags=["admin: audit"])


class AuditOut(BaseModel):
    id: int
    actor: str  # the admin key's prefix
    action: str
    target: str | None
    result: str  # "ok" or the error's code
    detail: str | None = None  # what it did, where the action says (e.g. an erasure's blocks by tier)
    at: datetime

    @classmethod
    def of(cls, a: AdminAudit) -> AuditOut:
        return cls(id=a.id, actor=a.actor, action=a.action, target=a.target, result=a.result, detail=a.detail, at=a.at)


@router.get("", response_model=list[AuditOut])
async def list_audit(
    tenant: AdminDep,
    db: DbDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[QueryOffset, Query()] = 0,
) -> list[AuditOut]:
    return [AuditOut.of(a) for a in await audit.list_entries(db, tenant.id, limit, offset)]
