"""Admin: the tenant's reply settings — how the bot samples, its penalties against loops, its stop strings, and
how it uses the tenant's tools. ``PUT`` replaces them (the next turn of every session uses them), ``PATCH`` changes
the fields it names (``backend/api/partial.py``), ``DELETE`` returns to the server's defaults (``KVCHAT_REPLY_*``)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, SettingsDep, audited
from backend.api.partial import merged, partial_model
from backend.core.limits import SafeText
from backend.engine_client.values import RepetitionScope
from backend.services import reply_settings
from backend.services.reply_settings import ReplySettings, ToolUse

router = APIRouter(prefix="/admin/tenant/reply-settings", tags=["admin: tenant"])
StopString = Annotated[SafeText, Field(min_length=1, max_length=200)]


class ReplySettingsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000, description="0 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="0 = off")
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=2.0, description="1 = off; > 1 discourages repeats")
    repetition_penalty_scope: RepetitionScope = Field(
        default=RepetitionScope.REPLY,
        description="the tokens the repetition penalty covers: the reply's own (the chat's default) or all (the "
        "prompt's too, vLLM's way)",
    )
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: list[StopString] = Field(default_factory=list, max_length=16, description="the reply ends before any")
    tool_use: ToolUse = Field(default=ToolUse.AUTO, description="auto, required (every turn calls a tool) or none")

    def settings(self) -> ReplySettings:
        return ReplySettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_penalty_scope=self.repetition_penalty_scope,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=tuple(self.stop),
            tool_use=self.tool_use,
        )


class ReplySettingsOut(ReplySettingsIn):
    source: Literal["tenant", "defaults"] = Field(description="the tenant's own settings, or the server's defaults")

    @classmethod
    def of(cls, s: ReplySettings, source: Literal["tenant", "defaults"]) -> ReplySettingsOut:
        return cls(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            repetition_penalty_scope=s.repetition_penalty_scope,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            stop=list(s.stop),
            tool_use=s.tool_use,
            source=source,
        )


ReplySettingsPatch = partial_model(ReplySettingsIn)


@router.get("", response_model=ReplySettingsOut)
async def get_reply_settings(tenant: AdminDep, db: DbDep, settings: SettingsDep) -> ReplySettingsOut:
    own = await reply_settings.has_own(db, tenant.id)
    current = await reply_settings.load(db, tenant.id, reply_settings.defaults_of(settings))
    return ReplySettingsOut.of(current, "tenant" if own else "defaults")


@router.put("", response_model=ReplySettingsOut, dependencies=[audited("tenant.reply_settings")])
async def set_reply_settings(body: ReplySettingsIn, tenant: AdminDep, db: DbDep) -> ReplySettingsOut:
    """Replace the tenant's reply settings; the next turn of every session uses them."""
    return ReplySettingsOut.of(await reply_settings.save(db, tenant.id, body.settings()), "tenant")


@router.patch("", response_model=ReplySettingsOut, dependencies=[audited("tenant.reply_settings")])
async def patch_reply_settings(
    body: ReplySettingsPatch,  # type: ignore[valid-type]
    tenant: AdminDep,
    db: DbDep,
    settings: SettingsDep,
) -> ReplySettingsOut:
    """Change the fields given (the others keep their value: the tenant's own, else the server's defaults)."""
    current = await get_reply_settings(tenant, db, settings)
    return await set_reply_settings(merged(current, body, ReplySettingsIn), tenant, db)


@router.delete("", response_model=ReplySettingsOut, dependencies=[audited("tenant.reply_settings.reset")])
async def reset_reply_settings(tenant: AdminDep, db: DbDep, settings: SettingsDep) -> ReplySettingsOut:
    """Back to the server's defaults."""
    await reply_settings.reset(db, tenant.id)
    return ReplySettingsOut.of(reply_settings.defaults_of(settings), "defaults")
