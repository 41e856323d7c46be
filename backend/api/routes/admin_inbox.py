"""Admin: the inbox at a glance, for the dashboard: the sessions waiting for a person or held by one (oldest request
first), the expected wait, and the time to a person's first reply (p50 / p95) over the last day."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from backend.api.deps import AdminDep, DbDep
from backend.chat.agent_desk import entry_frame
from backend.chat.agent_protocol import InboxEntry
from backend.services import inbox
from backend.services.inbox import InboxStats

router = APIRouter(prefix="/admin/inbox", tags=["admin: agents"])


class InboxStatsOut(BaseModel):
    waiting: int = Field(description="sessions waiting for a person now")
    held: int = Field(description="sessions a person holds now")
    expected_wait_s: float | None = Field(description="the median wait for a first claim, latest 20 of the last day")
    handoffs_last_day: int
    first_reply_p50_s: float | None = Field(description="request to a person's first reply, answered in the last day")
    first_reply_p95_s: float | None
    queue: list[InboxEntry]

    @classmethod
    def of(cls, s: InboxStats) -> InboxStatsOut:
        waiting = sum(1 for e in s.queue if e.holder is None)
        return cls(
            waiting=waiting,
            held=len(s.queue) - waiting,
            expected_wait_s=s.expected_wait_s,
            handoffs_last_day=s.handoffs,
            first_reply_p50_s=s.first_reply_p50_s,
            first_reply_p95_s=s.first_reply_p95_s,
            queue=[entry_frame(e) for e in s.queue],
        )


@router.get("", response_model=InboxStatsOut)
async def get_inbox(tenant: AdminDep, db: DbDep) -> InboxStatsOut:
    return InboxStatsOut.of(await inbox.stats(db, tenant.id))
