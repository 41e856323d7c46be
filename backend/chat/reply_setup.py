"""What a turn's reply is made with, read once per turn: the tenant's reply settings (else the server's defaults)
and, unless its tools are off (``tool_use`` ``none``), its enabled tools."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from backend.services import reply_settings, tenant_tools
from backend.services.reply_settings import ReplySettings, ToolUse
from backend.services.tenant_tools import ToolEndpoint


@dataclass(frozen=True, slots=True)
class ReplySetup:
    settings: ReplySettings
    tools: tuple[ToolEndpoint, ...] = ()  # offered to the model (empty: a plain reply)

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools)


async def load(db: AsyncSession, tenant_id: str, defaults: ReplySettings) -> ReplySetup:
    """The tenant's setup (read only: safe to retry)."""
    settings = await reply_settings.load(db, tenant_id, defaults)
    if settings.tool_use is ToolUse.NONE:
        return ReplySetup(settings)
    return ReplySetup(settings, tuple(await tenant_tools.enabled_endpoints(db, tenant_id)))
