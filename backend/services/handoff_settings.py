"""A tenant's hand-off settings: when the bot hands a session to a person on its own, besides the customer asking.

- ``no_progress_turns`` (0: off): after this many bot replies on the session's current topic (its topic epoch, since
  the last hand-off ended) the bot gives up on it. NOTE: "no progress" is read as "still on the same topic": a
  customer whose question is answered moves on (a new topic epoch, ``backend/context/topic.py``) or leaves; one who
  asks about the same thing N times is not being helped.
- ``on_tool_failure``: a reply whose tool call failed (the bot then says it could not look it up:
  ``backend/chat/tool_turn.GRACEFUL_REPLY``) hands off at once.

Each hand-off records its reason (``handoffs.reason``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.db.models import ChatSession, Handoff, Message, TenantHandoffSettings, TopicHistory
from backend.domain import MessageRole, MessageStatus


@dataclass(frozen=True, slots=True)
class HandoffSettings:
    no_progress_turns: int = 0
    on_tool_failure: bool = False

    @property
    def enabled(self) -> bool:
        return self.no_progress_turns > 0 or self.on_tool_failure


async def load(db: AsyncSession, tenant_id: str) -> HandoffSettings:
    row = await db.get(TenantHandoffSettings, tenant_id)
    return HandoffSettings() if row is None else HandoffSettings(row.no_progress_turns, row.on_tool_failure)


async def save(db: AsyncSession, tenant_id: str, settings: HandoffSettings) -> HandoffSettings:
    row = await db.get(TenantHandoffSettings, tenant_id)
    if row is None:
        row = TenantHandoffSettings(tenant_id=tenant_id)
        db.add(row)
    row.no_progress_turns, row.on_tool_failure = settings.no_progress_turns, settings.on_tool_failure
    await db.commit()
    return settings


async def bot_turns_on_topic(db: AsyncSession, session_id: str) -> int:
    """The bot's complete replies to customer messages of the session's current topic epoch, since its last hand-off
    ended."""
    session = await db.get(ChatSession, session_id, populate_existing=True)
    if session is None:
        return 0
    epoch_start = await db.scalar(
        select(func.min(TopicHistory.message_seq)).where(
            TopicHistory.session_id == session_id, TopicHistory.topic_epoch == session.topic_epoch
        )
    )
    handed_back = await db.scalar(select(func.max(Handoff.ended_at)).where(Handoff.session_id == session_id))
    query = select(func.count()).where(
        Message.session_id == session_id,
        Message.role == MessageRole.ASSISTANT.value,
        Message.status == MessageStatus.COMPLETE.value,
        Message.reply_to_seq >= (epoch_start or 0),
    )
    if handed_back is not None:
        query = query.where(Message.created_at > handed_back)
    return int(await db.scalar(query) or 0)
