"""Step 2 of a customer message's path (``turn_path.py``): the message stored and its turn's context read, in one
transaction.

The reads go first, before the session's lock (``_read_then_store``): on SQLite the lock is the database's one
writer (``backend/db/sqlite_writer.py``), and a transaction that reads while holding it holds every other turn's
writes too. The message's seq is the read's last seq + 1; a message stored meanwhile has that seq
(``uq_messages_session_seq``), so the insert fails and the step runs again with the reads under the lock
(``_lock_then_read``), as does a retried ``client_msg_id`` (a reconnect: its stored reply is replayed).

The reads are one round trip on Postgres (``services/turn_read.py``). Between the read and the lock, a message the
bot is to answer has its turn's plan started on a CPU worker (``turn_plan.py``): it runs beside the lock and the
commit, and is dropped when the store has to read again or no bot turn follows.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat import reply_setup
from backend.chat.agent_desk import AgentDesk
from backend.chat.prompt import asks_for_human
from backend.chat.protocol import UserMessage
from backend.chat.reply_setup import ReplySetup
from backend.chat.turn_plan import Planned, TurnPlanner, drop
from backend.chat.turns import Turns
from backend.core.errors import SessionClosedError
from backend.db.models import Message
from backend.domain import MessageRole, SessionStatus
from backend.services import sessions as store
from backend.services import turn_read
from backend.services.context_service import ContextService, SessionContext
from backend.services.handoff_settings import HandoffSettings
from backend.services.reply_settings import ReplySettings


@dataclass(frozen=True, slots=True)
class Stored:
    """What step 2's transaction leaves: the message (``duplicate``: stored before, a retry), the status it was
    stored under, a retry's stored reply, the session's context with the message, and the tenant's reply setup."""

    message: Message
    duplicate: bool
    before: SessionStatus
    reply: Message | None
    context: SessionContext
    setup: ReplySetup
    handoff: HandoffSettings
    read_again: bool = False  # a turn of the session was in flight in this process at the read: it stores after it
    planned: asyncio.Future[Planned] | None = None  # step 7, started after the read (``turn_plan.py``)


class MessageStore:
    """Stores a customer message with the context its turn reads (``store``)."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        context: ContextService,
        desk: AgentDesk,
        turns: Turns,
        defaults: ReplySettings,
        planner: TurnPlanner,
    ) -> None:
        self._sm = sessionmaker
        self._context = context
        self._desk = desk
        self._turns = turns
        self._defaults = defaults  # the server's reply settings, for tenants without their own
        self._planner = planner

    async def store(self, tenant_id: str, session_id: str, frame: UserMessage) -> Stored:
        """Step 2, one transaction: the context read, then the session locked and the message stored.

        The reads go first, before the lock (``_read_then_store``): on SQLite the lock is the database's one writer
        (``backend/db/sqlite_writer.py``), and every trip to the database made while holding it holds every other
        turn's writes too. The message's seq is the read's last seq + 1; a message stored meanwhile has that seq
        (``uq_messages_session_seq``), so the insert fails and the step runs again with the reads under the lock
        (``_lock_then_read``), as does a retried ``client_msg_id`` (rare: a reconnect) and a unique-key race with
        another process storing the same ``client_msg_id``."""
        try:
            async with self._sm() as db:
                stored = await self._read_then_store(db, tenant_id, session_id, frame)
            if stored is not None:
                return stored
        except IntegrityError:
            pass
        try:
            async with self._sm() as db:
                return await self._lock_then_read(db, tenant_id, session_id, frame)
        except IntegrityError:
            async with self._sm() as db:
                return await self._lock_then_read(db, tenant_id, session_id, frame)

    async def read(self, db: AsyncSession, tenant_id: str, session_id: str) -> tuple[SessionContext, ReplySetup]:
        """The turn's context and the tenant's reply setup (read only: safe to retry), in one round trip on Postgres
        (``turn_read.py``)."""
        _, ctx, setup = await self._read(db, tenant_id, session_id)
        return ctx, setup

    async def _read(
        self, db: AsyncSession, tenant_id: str, session_id: str
    ) -> tuple[SessionStatus, SessionContext, ReplySetup]:
        rows = await turn_read.read(db, tenant_id, session_id)
        ctx = await self._context.context_of(db, rows)
        return SessionStatus(rows.session.status), ctx, reply_setup.of_rows(rows, self._defaults)

    async def _read_then_store(
        self, db: AsyncSession, tenant_id: str, session_id: str, frame: UserMessage
    ) -> Stored | None:
        """The common case: read, lock, store a new message, commit (three trips hold SQLite's writer). None when
        the message was stored before (a retry: ``_lock_then_read`` replays it) or the session's topic or pinned
        context changed after the read. A message the bot is to answer, with no other turn of the session in
        flight, has its turn's plan started after the read (``TurnPlanner.ahead``), beside the lock and the commit."""
        in_flight = self._turns.in_flight(session_id) is not None  # NOTE: known before the read
        status, ctx, setup = await self._read(db, tenant_id, session_id)
        handoff = await self._desk.handoff_settings(tenant_id, db)  # (from memory, mostly)
        if any(_sent_as(m, frame.client_msg_id) for m in ctx.messages):
            return None
        answers = _bot_answers(status, frame.text)  # (as read: the lock may find the session moved on)
        message = store.user_message(session_id, ctx.last_seq + 1, frame.client_msg_id, frame.text, answers)
        with_message = ctx.with_message(message)
        planned = None
        if answers and not in_flight:
            planned = self._planner.ahead(tenant_id, with_message, message, setup)
        try:
            stored = await self._lock_and_store(db, tenant_id, session_id, frame, ctx, message, in_flight)
        except BaseException:
            drop(planned)
            raise
        if stored is None:
            drop(planned)
            return None
        before, read_again = stored
        if read_again or not _bot_answers(before, frame.text):
            drop(planned)  # (read again after the turn in flight; or no bot turn)
            planned = None
        return Stored(message, False, before, None, with_message, setup, handoff, read_again, planned)

    async def _lock_and_store(
        self,
        db: AsyncSession,
        tenant_id: str,
        session_id: str,
        frame: UserMessage,
        ctx: SessionContext,
        message: Message,
        in_flight: bool,
    ) -> tuple[SessionStatus, bool] | None:
        """The session locked and the message stored as read (its status as the lock found the session); the status
        before it and whether a turn of the session started meanwhile. None: the topic or pinned context moved."""
        session = await store.lock_session(db, tenant_id, session_id)
        if session.status == SessionStatus.CLOSED.value:
            raise SessionClosedError("this session is closed; start a new one")
        before = SessionStatus(session.status)
        if (session.topic_epoch, session.semantic_temperature, session.pinned_context) != (
            ctx.epoch,
            ctx.temperature,
            ctx.pinned_context,
        ):
            await db.rollback()  # the topic or the pinned context moved after the read: read under the lock
            return None
        # NOTE: a turn that started between the read and the lock makes this turn read its context again, after it.
        read_again = in_flight or self._turns.in_flight(session_id) is not None
        store.stage_user_message(db, message, _bot_answers(before, frame.text))
        await db.commit()
        return before, read_again

    async def _lock_then_read(self, db: AsyncSession, tenant_id: str, session_id: str, frame: UserMessage) -> Stored:
        """The reads under the session's lock (a write: SQLite's writer, Postgres's row lock), so the status, the
        messages and the next seq read are the ones the message is stored under; a closed session leaves by the
        rollback. A retried ``client_msg_id`` is found among the messages read and its reply replayed."""
        session = await store.lock_session(db, tenant_id, session_id)
        if session.status == SessionStatus.CLOSED.value:
            raise SessionClosedError("this session is closed; start a new one")
        before = SessionStatus(session.status)
        read_again = self._turns.in_flight(session_id) is not None  # NOTE: known under the lock, before the read
        ctx, setup = await self.read(db, tenant_id, session_id)
        handoff = await self._desk.handoff_settings(tenant_id, db)  # (from memory, mostly)
        message = next((m for m in ctx.messages if _sent_as(m, frame.client_msg_id)), None)
        if message is not None:
            reply = max((m for m in ctx.messages if m.reply_to_seq == message.seq), key=_seq, default=None)
            attached = self._turns.get(session_id, frame.client_msg_id) is not None
            if reply is None and before == SessionStatus.BOT_ACTIVE and not attached:
                await store.await_reply(db, message)  # a retry restarts a turn that left no reply: owed one again
            await db.commit()
            return Stored(message, True, before, reply, ctx, setup, handoff, read_again)
        awaiting = _bot_answers(before, frame.text)
        message = store.user_message(session_id, ctx.last_seq + 1, frame.client_msg_id, frame.text, awaiting)
        store.stage_user_message(db, message, awaiting)
        await db.commit()
        return Stored(message, False, before, None, ctx.with_message(message), setup, handoff, read_again)


def _sent_as(m: Message, client_msg_id: str) -> bool:
    return m.role == MessageRole.USER.value and m.client_msg_id == client_msg_id


def _seq(m: Message) -> int:
    return m.seq


def _bot_answers(status: SessionStatus, text: str) -> bool:
    """Whether a new customer message starts a bot turn (mirrors ``TurnPath._after_customer_message``)."""
    return status in (SessionStatus.BOT_ACTIVE, SessionStatus.RESOLVED) and not asks_for_human(text)
