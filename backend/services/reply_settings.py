"""A tenant's reply settings: how the bot samples (temperature, top-p, top-k, min-p), its penalties against loops,
its stop strings, and how it uses the tenant's tools. No row means the server's defaults (``KVCHAT_REPLY_*``), so a
change of the defaults reaches every tenant that never set its own. ``load`` adds the tenant's suffix-drafts choice
(``tenants.drafts``), which every reply's parameters carry."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.config import Settings
from backend.core.errors import InvalidReplySettingsError
from backend.db.models import Tenant, TenantReplySettings
from backend.domain import DraftsSetting
from backend.engine_client.values import (
    InvalidSamplingParamsError,
    RepetitionScope,
    SamplingParams,
    StructuredOutput,
)


class ToolUse(enum.StrEnum):
    """How the bot uses the tenant's tools during a turn."""

    AUTO = "auto"  # the model decides whether to call one
    REQUIRED = "required"  # every turn starts with a call (a grammar holds the model to it)
    NONE = "none"  # tools are not offered


@dataclass(frozen=True, slots=True)
class ReplySettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_penalty_scope: RepetitionScope = RepetitionScope.ALL
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    tool_use: ToolUse = ToolUse.AUTO
    # NOTE: not a reply-settings column: the tenant's suffix-drafts choice (``tenants.drafts``, which ``load`` reads
    # beside these), carried here so every reply's parameters take it. None: the engine's switch.
    drafts: bool | None = None

    def params(self, max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's parameters for one reply (raises ``InvalidSamplingParamsError`` for a value it refuses)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_penalty_scope=self.repetition_penalty_scope,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=self.stop,
            structured=structured,
            drafts=self.drafts,
        )

    def checked(self) -> ReplySettings:
        """These settings, or ``InvalidReplySettingsError`` naming what the engine refuses."""
        try:
            self.params(max_tokens=1)
        except InvalidSamplingParamsError as exc:
            raise InvalidReplySettingsError(str(exc)) from None
        return self


def defaults_of(settings: Settings) -> ReplySettings:
    """The server's defaults (``KVCHAT_REPLY_*``): what a tenant without its own settings gets."""
    return ReplySettings(
        temperature=settings.reply_temperature,
        top_p=settings.reply_top_p,
        top_k=settings.reply_top_k,
        min_p=settings.reply_min_p,
        repetition_penalty=settings.reply_repetition_penalty,
        repetition_penalty_scope=settings.reply_repetition_penalty_scope,
        presence_penalty=settings.reply_presence_penalty,
        frequency_penalty=settings.reply_frequency_penalty,
    )


async def has_own(db: AsyncSession, tenant_id: str) -> bool:
    return await db.get(TenantReplySettings, tenant_id) is not None


async def load(db: AsyncSession, tenant_id: str, defaults: ReplySettings) -> ReplySettings:
    """The tenant's settings, else ``defaults``; with its suffix-drafts choice (``tenants.drafts``) either way.

    NOTE: one statement for both (the tenant's row joined to its settings' row). A chat turn reads them with its
    context instead (``turn_read.py``) and makes them with ``of_rows``.
    """
    found = await db.execute(
        select(Tenant.drafts, TenantReplySettings)
        .outerjoin(TenantReplySettings, TenantReplySettings.tenant_id == Tenant.id)
        .where(Tenant.id == tenant_id)
    )
    drafts, settings = found.first() or (DraftsSetting.DEFAULT, None)
    return of_rows(drafts, settings, defaults)


async def row(db: AsyncSession, tenant_id: str) -> TenantReplySettings | None:
    """The tenant's settings row, if it has one."""
    return await db.scalar(select(TenantReplySettings).where(TenantReplySettings.tenant_id == tenant_id))


def of_rows(drafts: str, settings: TenantReplySettings | None, defaults: ReplySettings) -> ReplySettings:
    """The settings from the tenant's ``drafts`` choice and its settings row (None: ``defaults``)."""
    wanted = DraftsSetting(drafts).wanted()
    if settings is None:
        return dataclasses.replace(defaults, drafts=wanted)
    return ReplySettings(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        repetition_penalty_scope=RepetitionScope(settings.repetition_penalty_scope),
        presence_penalty=settings.presence_penalty,
        frequency_penalty=settings.frequency_penalty,
        stop=tuple(json.loads(settings.stop)),
        tool_use=ToolUse(settings.tool_choice),
        drafts=wanted,
    )


async def save(db: AsyncSession, tenant_id: str, settings: ReplySettings) -> ReplySettings:
    """Store the tenant's settings (checked first); the next turn of every session uses them."""
    settings.checked()
    values = dataclasses.asdict(settings)
    values["stop"] = json.dumps(list(settings.stop))
    values["tool_choice"] = values.pop("tool_use").value
    values["repetition_penalty_scope"] = settings.repetition_penalty_scope.value
    del values["drafts"]  # (the tenant's, stored on its row: ``tenants.set_drafts``)
    row = await db.get(TenantReplySettings, tenant_id)
    if row is None:
        db.add(TenantReplySettings(tenant_id=tenant_id, **values))
    else:
        for name, value in values.items():
            setattr(row, name, value)
    await db.commit()
    return settings


async def reset(db: AsyncSession, tenant_id: str) -> None:
    """Back to the server's defaults."""
    await db.execute(delete(TenantReplySettings).where(TenantReplySettings.tenant_id == tenant_id))
    await db.commit()
