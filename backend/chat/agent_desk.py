"""The agent desk: what a hand-off, a claim, an agent's reply or a hand-back changes, stored
(``backend/services/inbox.py``) and then announced on the hub, so every worker's sockets hear it (the fan-out carries
hub frames over LISTEN/NOTIFY):

- the customer's sockets (the session's key): ``session.status``, ``session.agent`` (who they talk to),
  ``agent.message``, ``typing``, ``session.queue`` (their place and the expected wait while they wait);
- the tenant's agent sockets (``inbox_channel``): ``inbox.handoff``, ``inbox.changed``, ``inbox.message``,
  ``agent.message``, ``typing``.

While a person holds the session the bot sends nothing (``ChatService`` starts no turn for a session that is not
``bot_active``). After a hand-back, the agent's messages are ordinary history for the bot: they are assistant turns of
the prompt in the order they were written (``backend/services/context_service.py``), so the next prompt still extends
the cached prefix of the last one.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.agent_protocol import (
    AgentMessageFrame,
    InboxChangedFrame,
    InboxEntry,
    InboxHandoffFrame,
    InboxMessageFrame,
    SessionAgentFrame,
    SessionQueueFrame,
    TypingFrame,
    inbox_channel,
)
from backend.chat.hub import SessionHub
from backend.chat.protocol import SessionStatusFrame
from backend.chat.tool_turn import GRACEFUL_REPLY
from backend.core.agent_metrics import AgentMetrics
from backend.db.models import AgentNote, ChatSession, Message
from backend.domain import HandoffOutcome, HandoffReason, MessageStatus, SessionStatus
from backend.services import agents, handoff_settings, inbox
from backend.services import sessions as store
from backend.services.agents import Actor
from backend.services.handoff_settings import HandoffSettings
from backend.services.inbox import HandoffChange, QueueEntry

log = logging.getLogger("kvchat.agents")

SETTINGS_TTL_S = 5.0
_OUTCOMES = {
    SessionStatus.CLOSED: HandoffOutcome.CLOSED,
    SessionStatus.RESOLVED: HandoffOutcome.RESOLVED,
    SessionStatus.BOT_ACTIVE: HandoffOutcome.HANDED_BACK,
}
WAITING = frozenset({SessionStatus.AGENT_REQUESTED, SessionStatus.AGENT_ACTIVE})


def entry_frame(e: QueueEntry) -> InboxEntry:
    return InboxEntry(
        session_id=e.session_id,
        status=e.status.value,
        reason=e.reason.value,
        requested_at=e.requested_at,
        waited_s=e.waited_s,
        holder_name=e.holder_name,
        last_customer_message=e.last_customer_message,
        topic_epoch=e.topic_epoch,
        temperature=e.temperature,
    )


class AgentDesk:
    """The inbox's steps, announced (see the module's docstring). Runs on the event loop."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        hub: SessionHub,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self._sm = sessionmaker
        self._hub = hub
        self._metrics = metrics
        self._settings: dict[str, tuple[float, HandoffSettings]] = {}  # tenant -> (read at, settings)

    # ------------------------------------------------------------------ the customer's side

    async def handoff(self, session_id: str, reason: HandoffReason) -> SessionStatus:
        """The session asks for a person; returns its status after (already ``agent_requested``/``agent_active``:
        unchanged)."""
        async with self._sm() as db:
            change = await inbox.request(db, session_id, reason)
        if change is None:  # one is open already
            async with self._sm() as db:
                session = await db.get(ChatSession, session_id, populate_existing=True)
            return SessionStatus(session.status) if session is not None else SessionStatus.CLOSED
        self._hub.publish(session_id, SessionStatusFrame(session_id=session_id, status=change.status.value))
        async with self._sm() as db:
            entry = next((e for e in await inbox.queue(db, change.tenant_id) if e.session_id == session_id), None)
        if entry is not None:  # (None: it ended meanwhile, an admin closed it)
            self._hub.publish(inbox_channel(change.tenant_id), InboxHandoffFrame(entry=entry_frame(entry)))
        waiting = await self._announce_places(change.tenant_id, only=session_id)
        if self._metrics is not None:
            self._metrics.handoffs.labels(reason.value).inc()
            self._metrics.queue_length.observe(waiting)
        return change.status

    async def customer_wrote(self, tenant_id: str, message: Message, status: SessionStatus) -> None:
        """A customer message in a session of the inbox: to the agents; a waiting customer hears their place."""
        frame = InboxMessageFrame(
            session_id=message.session_id, seq=message.seq, text=message.content, created_at=message.created_at
        )
        self._hub.publish(inbox_channel(tenant_id), frame)
        if status == SessionStatus.AGENT_REQUESTED:
            await self._announce_places(tenant_id, only=message.session_id)

    async def handoff_settings(self, tenant_id: str, db: AsyncSession | None = None) -> HandoffSettings:
        """The tenant's hand-off settings, read at most every ``SETTINGS_TTL_S`` per process (in ``db`` when given:
        the transaction that stores the turn's message).

        NOTE: read before a turn runs, from memory mostly: the check after the reply then touches the database only
        for a tenant that turned the bot's own hand-offs on. A change reaches every worker within the TTL.
        """
        now = time.monotonic()
        known = self._settings.get(tenant_id)
        if known is not None and now - known[0] < SETTINGS_TTL_S:
            return known[1]
        try:
            if db is not None:
                settings = await handoff_settings.load(db, tenant_id)
            else:
                async with self._sm() as own:
                    settings = await handoff_settings.load(own, tenant_id)
        except Exception:  # NOTE: the turn goes on (without the bot's own hand-offs) when the read fails
            log.exception("reading the hand-off settings of %s failed", tenant_id)
            return known[1] if known is not None else HandoffSettings()
        self._settings[tenant_id] = (now, settings)
        return settings

    async def after_bot_turn(self, settings: HandoffSettings, session_id: str, user_seq: int) -> None:
        """The bot's own choice (the tenant's hand-off ``settings``): hand off after a failed tool call, or after N
        replies on one topic. Never fails the turn: a failure here is logged."""
        if not settings.enabled:
            return
        try:
            reason = await self._bot_gives_up(settings, session_id, user_seq)
            if reason is not None:
                await self.handoff(session_id, reason)
        except Exception:
            log.exception("the hand-off check after %s/%d failed", session_id, user_seq)

    async def _bot_gives_up(self, settings: HandoffSettings, session_id: str, user_seq: int) -> HandoffReason | None:
        async with self._sm() as db:
            reply = await store.find_reply(db, session_id, user_seq)
            if reply is None or reply.status != MessageStatus.COMPLETE.value:
                return None
            if settings.on_tool_failure and reply.tool_exchange and reply.content.endswith(GRACEFUL_REPLY):
                return HandoffReason.TOOL_FAILED
            turns = settings.no_progress_turns
            if turns and await handoff_settings.bot_turns_on_topic(db, session_id) >= turns:
                return HandoffReason.NO_PROGRESS
        return None

    def customer_typing(self, tenant_id: str, session_id: str) -> None:
        self._hub.publish(inbox_channel(tenant_id), TypingFrame(session_id=session_id, who="customer"))

    async def status_set(self, session_id: str, status: SessionStatus) -> None:
        """The session's status was set outside the inbox (closed when idle, an admin's change): an open hand-off
        ends with it, and the agents hear so."""
        outcome = _OUTCOMES.get(status)
        if outcome is None:
            return
        async with self._sm() as db:
            session = await store.lock_any(db, session_id)
            ended = await inbox.settle_open(db, session_id, outcome)
            await db.commit()
        if ended:
            event = "closed" if outcome == HandoffOutcome.CLOSED else outcome.value
            frame = InboxChangedFrame.model_validate({"session_id": session_id, "event": event, "status": status.value})
            self._hub.publish(inbox_channel(session.tenant_id), frame)

    # ------------------------------------------------------------------ the agents' side

    async def queue(self, actor: Actor) -> list[QueueEntry]:
        async with self._sm() as db:
            return await inbox.queue(db, actor.tenant.id)

    async def claim(self, actor: Actor, session_id: str) -> HandoffChange:
        async with self._sm() as db:
            change = await inbox.claim(db, actor, session_id)
        if self._metrics is not None and change.first_wait_s is not None:
            self._metrics.wait.observe(change.first_wait_s)
        if change.previous_holder_name != change.holder_name:  # (not a retry of one's own claim)
            self._announce(change, "claimed", SessionAgentFrame(session_id=session_id, event="joined"))
            await self._announce_places(change.tenant_id)
        return change

    async def release(self, actor: Actor, session_id: str) -> HandoffChange:
        async with self._sm() as db:
            change = await inbox.release(db, actor, session_id)
        self._announce(change, "released", SessionAgentFrame(session_id=session_id, event="left"))
        await self._announce_places(change.tenant_id)
        return change

    async def transfer(self, actor: Actor, session_id: str, to_agent_id: str) -> HandoffChange:
        async with self._sm() as db:
            change = await inbox.transfer(db, actor, session_id, to_agent_id)
        self._announce(change, "transferred", SessionAgentFrame(session_id=session_id, event="transferred"))
        await self._announce_places(change.tenant_id)
        return change

    async def hand_back(self, actor: Actor, session_id: str) -> HandoffChange:
        """The bot answers the session's next customer message, with the agent's turns in its context."""
        return await self._end(actor, session_id, HandoffOutcome.HANDED_BACK)

    async def resolve(self, actor: Actor, session_id: str) -> HandoffChange:
        return await self._end(actor, session_id, HandoffOutcome.RESOLVED)

    async def reply(self, actor: Actor, session_id: str, text: str) -> Message:
        """Store the agent's reply and stream it to the customer's sockets (every worker's) and to the inbox."""
        async with self._sm() as db:
            stored = await inbox.reply(db, actor, session_id, text)
        message = stored.message
        if self._metrics is not None and stored.first_reply_s is not None:
            self._metrics.first_reply.observe(stored.first_reply_s)
        frame = AgentMessageFrame(
            session_id=session_id, seq=message.seq, agent_name=actor.name, text=text, created_at=message.created_at
        )
        self._hub.publish(session_id, frame)
        self._hub.publish(inbox_channel(actor.tenant.id), frame)
        return message

    async def typing(self, actor: Actor, session_id: str) -> None:
        """The agent is typing in a session of their tenant (others' sessions are ignored: nothing to tell)."""
        async with self._sm() as db:
            session = await db.get(ChatSession, session_id)
        if session is None or session.tenant_id != actor.tenant.id:
            return
        self._hub.publish(session_id, TypingFrame(session_id=session_id, who="agent", name=actor.name))

    async def transcript(self, actor: Actor, session_id: str) -> tuple[list[Message], dict[str, str]]:
        """The tenant's session's messages, and the names of the agents who wrote some of them."""
        async with self._sm() as db:
            await store.get_session(db, actor.tenant.id, session_id)
            messages = await store.messages_after(db, session_id, 0)
            return messages, await agents.names_of(db, {m.agent_id for m in messages if m.agent_id is not None})

    async def add_note(self, actor: Actor, session_id: str, text: str) -> AgentNote:
        async with self._sm() as db:
            return await inbox.add_note(db, actor, session_id, text)

    async def notes(self, actor: Actor, session_id: str) -> list[AgentNote]:
        async with self._sm() as db:
            return await inbox.notes(db, actor.tenant.id, session_id)

    # ------------------------------------------------------------------ announcing

    async def _end(self, actor: Actor, session_id: str, outcome: HandoffOutcome) -> HandoffChange:
        async with self._sm() as db:
            change = await inbox.end(db, actor, session_id, outcome)
        resolved = outcome == HandoffOutcome.RESOLVED
        to_customer = SessionAgentFrame(session_id=session_id, event="resolved" if resolved else "handed_back")
        self._announce(change, to_customer.event, to_customer)
        await self._announce_places(change.tenant_id)
        return change

    def _announce(self, change: HandoffChange, event: str, to_customer: SessionAgentFrame) -> None:
        session_id = change.session_id
        self._hub.publish(session_id, SessionStatusFrame(session_id=session_id, status=change.status.value))
        joined = to_customer.event in ("joined", "transferred")
        name = change.holder_name if joined else change.previous_holder_name
        self._hub.publish(session_id, to_customer.model_copy(update={"agent_name": name}))
        changed = InboxChangedFrame.model_validate(
            {"session_id": session_id, "event": event, "status": change.status.value, "holder_name": change.holder_name}
        )
        self._hub.publish(inbox_channel(change.tenant_id), changed)

    async def _announce_places(self, tenant_id: str, only: str | None = None) -> int:
        """Tell waiting customers their place (``only``: that session's customer; else all of the tenant's); returns
        how many wait."""
        async with self._sm() as db:
            waiting = await inbox.waiting_sessions(db, tenant_id)
            expected = await inbox.expected_wait_s(db, tenant_id) if waiting else None
        for position, session_id in enumerate(waiting, start=1):
            if only is None or session_id == only:
                frame = SessionQueueFrame(session_id=session_id, position=position, expected_wait_s=expected)
                self._hub.publish(session_id, frame)
        return len(waiting)
