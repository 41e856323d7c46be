"""What a turn's reply is made with, read once per turn: the tenant's reply settings (else the server's defaults)
and, unless its tools are off (``tool_use`` ``none``), its enabled tools."""

from __future__ import annotations

from dataclasses import dataclass

from backend.services import reply_settings
from backend.services.reply_settings import ReplySettings, ToolUse
from backend.services.tenant_tools import ToolEndpoint
from backend.services.turn_read import TurnRows


@dataclass(frozen=True, slots=True)
class ReplySetup:
    settings: ReplySettings
    tools: tuple[ToolEndpoint, ...] = ()  # offered to the model (empty: a plain reply)

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools)


def of_rows(rows: TurnRows, defaults: ReplySettings) -> ReplySetup:
    """The tenant's setup from a turn's rows (``turn_read.read(with_reply=True)``: read with its context)."""
    settings = reply_settings.of_rows(rows.tenant.drafts, rows.reply, defaults)
    if settings.tool_use is ToolUse.NONE:
        return ReplySetup(settings)
    return ReplySetup(settings, tuple(ToolEndpoint.of(t) for t in rows.tools if t.enabled))
