"""Admin: the tenant's hand-off settings, when the bot hands a session to a person on its own
(``backend/services/handoff_settings.py``). Agent keys cannot change them."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, audited
from backend.services import handoff_settings
from backend.services.handoff_settings import HandoffSettings

router = APIRouter(prefix="/admin/tenant/handoff-settings", tags=["admin: agents"])


class HandoffSettingsIO(BaseModel):
    model_config = ConfigDict(extra="forbid")

    no_progress_turns: int = Field(
        ge=0, le=100, description="hand off after this many bot replies on one topic (0: never)"
    )
    on_tool_failure: bool = Field(description="hand off when a tool call of the bot fails")

    @classmethod
    def of(cls, s: HandoffSettings) -> HandoffSettingsIO:
        return cls(no_progress_turns=s.no_progress_turns, on_tool_failure=s.on_tool_failure)


@router.get("", response_model=HandoffSettingsIO)
async def get_handoff_settings(tenant: AdminDep, db: DbDep) -> HandoffSettingsIO:
    return HandoffSettingsIO.of(await handoff_settings.load(db, tenant.id))


@router.put("", response_model=HandoffSettingsIO, dependencies=[audited("tenant.handoff_settings")])
async def set_handoff_settings(body: HandoffSettingsIO, tenant: AdminDep, db: DbDep) -> HandoffSettingsIO:
    """Replace the settings; the next bot reply of every session is checked against them."""
    change = HandoffSettings(body.no_progress_turns, body.on_tool_failure)
    return HandoffSettingsIO.of(await handoff_settings.save(db, tenant.id, change))
