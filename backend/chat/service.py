"""The chat service owns a turn: persist the user message, decide whether the bot answers, stream the reply from
the engine to every socket of the session, persist the reply — exactly once per ``client_msg_id``.

Turn semantics:
* the user message is committed before generation starts;
* a retried ``client_msg_id`` never creates a second message or reply: the stored reply is replayed, or the retry
  attaches to the reply in flight (its socket is subscribed to the session and sees the remaining deltas);
* a reply keeps generating when the socket drops (the customer sees it on reconnect); a cancelled reply is stored as
  ``cancelled``, one cut short by shutdown or an engine failure as ``incomplete`` — never silently dropped;
* a message that can never be answered (system prompt + message + reply over the model's budget) is refused before
  the ack, and nothing is stored;
* a message the bot is to answer is stored ``awaiting_reply`` until its reply is; on start, ``recover_interrupted``
  gives the ones a crash cut off an ``incomplete`` marker;
* on shutdown, ``drain`` refuses new turns and lets the ones in flight finish (still streaming) for a grace period;
  the rest are stored with exactly the text published to the sockets, marked ``incomplete``;
* turns of one session run one at a time, in order; tokenizing runs in a worker thread, off the event loop, once per
  turn: the engine runs the tokenized prompt;
* a turn reads the session's context from the database once: the read its message was observed with, reused while
  nothing else of the session was stored since (``ContextService.is_current``);
* the context layer (``backend/services/context_service.py``) splits every stored message into blocks and moves the
  session's topic; the prompt is the context builder's, under the tenant's history policy; when it drops an epoch the
  previous prompt had, the engine frees those cached blocks. A failure there never costs the customer the reply.

The parts: this module decides what a message starts; ``backend/chat/turn.py`` runs a turn to its stored reply;
``backend/chat/turns.py`` keeps the turns in flight and drains them.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.agent_desk import WAITING, AgentDesk
from backend.chat.hub import Send, SessionHub
from backend.chat.prompt import ChatMessage, asks_for_human
from backend.chat.protocol import (
    Hello,
    InFlight,
    MessageAck,
    MessageCompleted,
    MessageOut,
    SessionStatusFrame,
    SessionTopicFrame,
    Topic,
    UserMessage,
    Welcome,
)
from backend.chat.turn import ReplyConfig, TurnRunner
from backend.chat.turn_state import Turn
from backend.chat.turns import DrainReport, Turns
from backend.context.builder import prefix_segments
from backend.core.agent_metrics import AgentMetrics
from backend.core.errors import MessageTooLongError, SessionClosedError, ShuttingDownError
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.db.models import Message, Tenant
from backend.domain import HandoffReason, InvalidationReason, MessageRole, MessageStatus, SessionStatus
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import ErasureResult
from backend.services import agents
from backend.services import sessions as store
from backend.services.agents import ADMIN_NAME
from backend.services.context_service import SYSTEM_ACTOR, ContextService, SessionContext
from backend.services.key_lookup import KeyLookup

log = logging.getLogger("kvchat.chat")


def message_out(m: Message, agent_names: dict[str, str] | None = None) -> MessageOut:
    agent_name = None
    if m.role == MessageRole.AGENT.value:  # (an admin key's reply, or a person deleted since: the support team)
        agent_name = (agent_names or {}).get(m.agent_id or "", ADMIN_NAME)
    return MessageOut(
        agent_name=agent_name,
        seq=m.seq,
        role=m.role,
        content=m.content,
        status=m.status,
        client_msg_id=m.client_msg_id,
        reply_to_seq=m.reply_to_seq,
        created_at=m.created_at,
    )


class ChatService:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        engine: EngineClient,
        hub: SessionHub,
        context: ContextService,
        reply: ReplyConfig | None = None,
        commit_delay_s: float = 0.0,
        metrics: Metrics | None = None,
    ) -> None:
        self._sm = self.sessionmaker = sessionmaker
        self._engine = engine
        self.context = context
        self.hub = hub
        self.keys = KeyLookup(sessionmaker, hub.keys)  # chat tokens, looked up once per burst (hello, /v1)
        self._metrics = metrics
        # human agents (backend/chat/agent_desk.py)
        self.desk = AgentDesk(sessionmaker, hub, context.changed, AgentMetrics(metrics.registry) if metrics else None)
        self._runner = TurnRunner(sessionmaker, engine, context, hub, reply or ReplyConfig(), metrics, commit_delay_s)
        self._turns = Turns(engine)

    @property
    def block_size(self) -> int:
        """Tokens per engine KV block."""
        return self._engine.info.block_size

    @property
    def reply(self) -> ReplyConfig:
        return self._runner.reply

    @property
    def accepting(self) -> bool:
        """False once a drain began: no new turns (``/readyz`` answers 503 then)."""
        return self._turns.accepting

    # ------------------------------------------------------------------ sessions

    async def open(self, tenant: Tenant, hello: Hello) -> Welcome:
        """Resume ``hello.session_id`` (replaying ``seq > last_seq``) or start a new session."""
        async with self._sm() as db:
            if hello.session_id:
                session = await store.get_session(db, tenant.id, hello.session_id)
                missed = await store.messages_after(db, session.id, hello.last_seq)
            else:
                session = await store.create_session(db, tenant.id, hello.external_ref)
                await db.commit()
                missed = []
            names = await agents.names_of(db, {m.agent_id for m in missed if m.agent_id is not None})
            last_seq = max((m.seq for m in missed), default=hello.last_seq)
        # NOTE: no await from here until the caller subscribes the socket: the text so far and the frames that
        # follow meet without a gap or an overlap, for this process's turns and (through the fan-out) the others'
        local = self._turns.in_flight(session.id)
        remote = None if local else self.hub.remote_in_flight(session.id)
        in_flight = local or remote
        return Welcome(
            session_id=session.id,
            status=session.status,
            messages=[message_out(m, names) for m in missed],
            last_seq=last_seq,
            in_flight=InFlight(client_msg_id=in_flight.client_msg_id, text=in_flight.text) if in_flight else None,
            cut_off=[
                m.reply_to_seq
                for m in missed
                if m.reply_to_seq is not None and m.status == MessageStatus.INCOMPLETE.value
            ],
            topic=Topic(epoch=session.topic_epoch, temperature=session.semantic_temperature),
        )

    def replies_in_flight(self, session_id: str) -> list[tuple[str, str]]:
        """(client_msg_id, text so far) of this process's replies streaming on the session (the fan-out's catch-up)."""
        return [(t.client_msg_id, t.text) for t in self._turns.streaming(session_id)]

    def claimed_turns(self) -> list[tuple[str, str]]:
        """The turns this process runs or has queued: (session id, client_msg_id) each."""
        return self._turns.claimed()

    async def recover_interrupted(self) -> int:
        """On start, before any turn runs: give every user message still awaiting a reply (its turn was cut off by a
        crash) an empty ``incomplete`` reply, so the customer sees a marker. Returns how many were marked.

        NOTE: marked, not answered: answering would replay a burst of stale turns into a fresh engine at start, and
        the customer may have moved on; a marker is safe, and sending the question again gets an answer. Another
        live process's awaiting messages are its turns in flight: the caller runs this only when none is connected.
        """
        async with self._sm() as db:
            awaiting = [(m.session_id, m.seq) for m in await store.awaiting_replies(db)]
        marked = 0
        for session_id, seq in awaiting:
            async with self._sm() as db:
                marked += await store.settle_interrupted(db, session_id, seq) is not None
        return marked

    async def set_status(
        self,
        session_id: str,
        status: SessionStatus,
        reason: InvalidationReason = InvalidationReason.SESSION_CLOSED,
        actor: str = SYSTEM_ACTOR,
    ) -> None:
        """Store and announce ``status``; closing releases the session's engine cache (an invalidation event with
        ``reason`` and ``actor``). Asking for a person goes through the inbox (a hand-off; a claim makes it
        ``agent_active``); any other status ends an open hand-off."""
        if status in WAITING:
            await self.desk.handoff(session_id, HandoffReason.ADMIN)
            return
        async with self._sm() as db:
            await store.set_status(db, session_id, status)
        self.hub.publish(session_id, SessionStatusFrame(session_id=session_id, status=status.value))
        await self.desk.status_set(session_id, status)
        if status == SessionStatus.CLOSED:
            freed = await self.release_cache(session_id)
            await self.context.record_release(session_id, freed, reason, actor)

    async def release_cache(self, session_id: str) -> int:
        """Release the engine cache only this session uses (demoted to disk when the engine has a disk tier);
        returns the blocks that left memory."""
        self._forget(session_id)
        freed = await control.release_session(self._engine, session_id)  # (disk writes: off the loop)
        log.info("released the engine cache of session %s (%d blocks)", session_id, freed)
        return freed

    async def erase_cache(self, session_id: str, namespace: str) -> ErasureResult:
        """Erasure (a deleted session): remove the session's blocks from every tier of the engine."""
        self._forget(session_id)
        erased = await control.erase_session(self._engine, session_id, namespace)
        log.info(
            "erased the engine cache of session %s (%d memory, %d disk blocks)",
            session_id,
            erased.memory_blocks,
            erased.disk_blocks,
        )
        return erased

    def _forget(self, session_id: str) -> None:
        self._turns.forget(session_id)
        self.context.forget(session_id)

    async def close_idle(self, idle_for: timedelta) -> list[str]:
        """Close sessions without activity for ``idle_for`` (and release their engine cache)."""
        async with self._sm() as db:
            ids = await store.idle_session_ids(db, idle_for)
        for session_id in ids:
            if self._turns.in_flight(session_id) is None:
                await self.set_status(session_id, SessionStatus.CLOSED, InvalidationReason.SESSION_TIMED_OUT)
        return ids

    # ------------------------------------------------------------------ turns

    async def submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        """Handle one ``user.message``; returns once the message is stored (the reply streams in the background)."""
        # NOTE: one submit per session at a time, so a retried client_msg_id racing its original (another socket of
        # the same session) sees the turn the original started instead of starting a second one.
        async with self._turns.submit_lock(session_id):
            await self._submit(tenant, session_id, frame, reply_to)

    async def _submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        if not self._turns.accepting:
            raise ShuttingDownError("the server is restarting; send the message again once reconnected")
        with self._turns.submitting():
            await self._check_answerable(tenant.id, _prefix_text(tenant), frame.text)
            await self._store_and_start(tenant, session_id, frame, reply_to)

    async def _store_and_start(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        async with self._sm() as db:
            # NOTE: locked first (a write: SQLite's write lock, Postgres's row lock), so the status read is the one the
            # message is stored under; a closed session or a duplicate leaves by the rollback.
            session = await store.lock_session(db, tenant.id, session_id)
            if session.status == SessionStatus.CLOSED.value:
                raise SessionClosedError("this session is closed; start a new one")
            before = SessionStatus(session.status)
            message, duplicate = await store.add_user_message(
                db, session_id, frame.client_msg_id, frame.text, _bot_answers(before, frame.text), locked=session
            )
            reply = await store.find_reply(db, session_id, message.seq) if duplicate else None
        if not duplicate:
            self.context.changed(session_id)
        reply_to(MessageAck(client_msg_id=frame.client_msg_id, seq=message.seq, duplicate=duplicate))
        if self._metrics is not None and not duplicate:
            self._metrics.messages.labels(MessageRole.USER.value).inc()
        if reply is not None:
            reply_to(_completed_from_stored(frame.client_msg_id, reply))
            return
        if self._turns.get(session_id, frame.client_msg_id) is not None:
            return  # attached: this socket already receives the session's deltas
        context = None if duplicate else await self._observe_customer(tenant.id, session_id, message)
        status = before if duplicate else await self._after_customer_message(session_id, before, frame.text)
        if status == SessionStatus.BOT_ACTIVE:
            if duplicate:  # a retry restarts a turn that left no reply (busy, an error): it is owed one again
                async with self._sm() as db:
                    await store.await_reply(db, message)
            turn = Turn(session_id, tenant.id, frame.client_msg_id, message.seq, context)
            self._turns.start(turn, self._run_turn)
        elif status == before:
            # NOTE: tell the sender no bot reply is coming (a status change was already published to everyone).
            reply_to(SessionStatusFrame(session_id=session_id, status=status.value))
            if status in WAITING and not duplicate:
                await self.desk.customer_wrote(tenant.id, message, status)

    async def _run_turn(self, turn: Turn) -> None:
        settings = await self.desk.handoff_settings(turn.tenant_id)
        await self._runner.run(turn)
        await self.desk.after_bot_turn(settings, turn.session_id, turn.user_seq)

    async def _observe_customer(self, tenant_id: str, session_id: str, message: Message) -> SessionContext | None:
        """Split the message, move the topic; announce a topic shift to every socket of the session. Returns the
        session's context as it stands after (the turn's prompt starts from it), or None when the layer failed."""
        try:
            observed = await self.context.observe_customer(tenant_id, session_id, message)
        except Exception:
            # NOTE: the context layer is bookkeeping around the turn: when it fails, the customer still gets a reply
            # (the message joins the history unsplit, in the epoch of the message before it).
            log.exception("the context layer failed on message %s/%d", session_id, message.seq)
            return None
        update = observed.update
        if update.shift:
            topic = Topic(epoch=update.epoch, temperature=update.temperature)
            self.hub.publish(session_id, SessionTopicFrame(session_id=session_id, seq=message.seq, topic=topic))
        return observed.context

    async def _check_answerable(self, tenant_id: str, system_prompt: str, text: str) -> None:
        """Refuse a message that could never be answered: with the system prompt and a reply it exceeds the budget."""
        messages = [*_system(system_prompt), {"role": MessageRole.USER.value, "content": text}]
        floor, budget = self._engine.prompt_token_floor(m["content"] for m in messages), self._runner.budget
        if floor > budget:  # NOTE: too long by its length alone: no need to spend the CPU on tokenizing it
            raise MessageTooLongError(floor, budget, at_least=True)
        tokens = len(await run_cpu(tenant_id, self._engine.tokenize, messages))
        if tokens > budget:
            raise MessageTooLongError(tokens, budget)

    async def _after_customer_message(self, session_id: str, status: SessionStatus, text: str) -> SessionStatus:
        if status == SessionStatus.RESOLVED:
            status = SessionStatus.BOT_ACTIVE  # a customer reply reopens a resolved session
            await self.set_status(session_id, status)
        if status == SessionStatus.BOT_ACTIVE and asks_for_human(text):
            status = await self.desk.handoff(session_id, HandoffReason.CUSTOMER_ASKED)
        return status

    def cancel(self, session_id: str, client_msg_id: str | None) -> bool:
        """Stop a reply (``client_msg_id``'s, else the session's in flight): it is stored ``cancelled``."""
        return self._turns.cancel(session_id, client_msg_id)

    async def drain(self, grace_s: float) -> DrainReport:
        """Stop taking turns; give those in flight ``grace_s`` to finish while they still stream to the sockets; cut
        off the rest: each is stored ``incomplete`` with exactly the text it published. Called on shutdown, before
        the server closes the sockets (``kvchat serve``), and again by the lifespan (a no-op by then)."""
        return await self._turns.drain(grace_s)

    async def wait_idle(self) -> None:
        """Wait for every turn in flight to finish (tests)."""
        await self._turns.wait_idle()


def _bot_answers(status: SessionStatus, text: str) -> bool:
    """Whether a new customer message starts a bot turn (mirrors ``ChatService._after_customer_message``)."""
    return status in (SessionStatus.BOT_ACTIVE, SessionStatus.RESOLVED) and not asks_for_human(text)


def _prefix_text(tenant: Tenant) -> str:
    """The text of the tenant's part 1 (system prompt and policy), as the context builder renders it."""
    return "".join(s.text for s in prefix_segments(tenant.system_prompt, tenant.policy_text))


def _system(system_prompt: str) -> list[ChatMessage]:
    return [{"role": MessageRole.SYSTEM.value, "content": system_prompt}] if system_prompt else []


def _completed_from_stored(client_msg_id: str, reply: Message) -> MessageCompleted:
    return MessageCompleted(
        client_msg_id=client_msg_id,
        seq=reply.seq,
        text=reply.content,
        status=reply.status,
        finish_reason="replayed",
        usage=None,
    )
