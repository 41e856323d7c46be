"""A customer message's path, from its ``user.message`` frame to the stored reply, read top to bottom here.

Each step names the module it runs in; the path enters each once and does not come back.

``submit`` (the socket's reader waits on it, up to the ack; steps 1 and 2 hold a slot of a gate fair by tenant,
``backend/core/fair_gate.py``, at most ``KVCHAT_TURN_SUBMIT_CONCURRENCY`` messages of all tenants at once):

0. the message's sentence vector for the section choice starts encoding on a CPU worker, beside steps 1 and 2,
   when the gate has room and the tenant no other CPU work queued (``ContextService.prefetch``: step 7 finds it in
   the encoder's cache; under load it would only run ahead of the plans of turns already stored);
1. the message can be answered at all: system prompt + message + reply within the model's budget
   (``answerable.py``; from its length alone for almost every message), else it is refused and nothing is stored;
2. ONE transaction (``message_store.py``): the context read with the tenant's reply settings and tools
   (``services/turn_read.py``: one round trip on Postgres; ``services/context_service.py`` builds the context) and
   its hand-off settings (``agent_desk.py``, from memory mostly); then step 7 starts on a CPU worker when the bot is
   to answer and no other turn of the session is in flight (``turn_plan.py``, ``TurnPlanner.ahead``), beside the
   session locked (``services/sessions.py``) and the message stored (``awaiting_reply`` when the bot is to answer
   it); one commit. A retried ``client_msg_id``, or a message stored between the read and the lock, runs it again
   with the reads under the lock (and drops the plan started ahead);
3. the ack; a retry gets its stored reply replayed, or attaches to its turn in flight, or starts its turn again;
4. the session's status after the message (``agent_desk.py``): a resolved session reopens; a request for a person
   hands off; while a person holds the session, the message is observed (topic, blocks) and goes to the agents, and
   no bot turn runs;
5. the bot's turn queued (``turns.py``: one at a time per session, in order).

``_run`` (the turn, a task):

6. the context: the one step 2 read, or read again when another turn of the session was in flight at that read (it
   stored its reply after it);
7. ONE worker-thread step (``turn_plan.py``), awaited when step 2 started it, else run here (``_plan``): the topic
   moved, the message split into blocks, the handbook section chosen, the prompt built and tokenized
   (``ContextService.plan``), and the reply's grounding for the contact guard (``grounding.py``);
8. the prompt to the engine at once (``reply_stream.py``, or ``tool_turn.py`` when tools are offered); beside the
   prefill, a task stores the bookkeeping (``_bookkeeping``: the message's blocks and topic row, the engine's
   temperature hint). Only a prompt that dropped a topic epoch the previous one had waits first, for the engine to
   free those cached blocks (``_free_dropped``);
9. the bookkeeping awaited, then the reply stored (``_store``: ``complete``, ``cancelled`` or ``incomplete``, with
   exactly the text published), its blocks stored, its completion published;
10. the bot's own hand-off check (``agent_desk.py``).

NOTE: the bookkeeping is awaited before the reply is stored, so the stored order is the order of a turn (message,
its blocks and topic, the reply, its blocks), and the session's next turn (which waits for this one) reads it all. A
crash after step 2 leaves the message ``awaiting_reply`` (``recover_interrupted`` marks it) and, possibly, without
blocks or a topic row: it then joins the history unsplit, in the epoch of the message before it. The message's own
segments reach the engine without their block row ids on this first prompt (the rows are written beside it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.agent_desk import WAITING, AgentDesk
from backend.chat.answerable import Answerable
from backend.chat.hub import Send, SessionHub
from backend.chat.message_store import MessageStore, Stored
from backend.chat.prompt import asks_for_human
from backend.chat.protocol import (
    ErrorFrame,
    MessageAck,
    MessageCompleted,
    SessionStatusFrame,
    SessionTopicFrame,
    Topic,
    Usage,
    UserMessage,
)
from backend.chat.reply_setup import ReplySetup
from backend.chat.reply_stream import ReplyStreamer
from backend.chat.tool_turn import ToolTurn
from backend.chat.turn import ReplyConfig, with_db_retry
from backend.chat.turn_marks import TurnMarks
from backend.chat.turn_plan import Planned, TurnPlanner, drop
from backend.chat.turn_state import Turn
from backend.chat.turns import Turns
from backend.context.builder import prefix_segments
from backend.context.contact_guard import ContactGuard
from backend.context.contacts import ContactKind
from backend.context.grounding import Grounding
from backend.core.errors import engine_error_code
from backend.core.fair_gate import FairGate
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.db.models import Message, Tenant
from backend.db.sqlite_driver import reads_inline
from backend.domain import HandoffReason, InvalidationReason, MessageRole, MessageStatus, SessionStatus
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import EngineBusy, EngineError, FinishReason, RequestFinished
from backend.services import sessions as store
from backend.services.context_service import SYSTEM_ACTOR, ContextService, Observation, Plan, SessionContext
from backend.services.tool_calls import ToolCaller
from backend.services.tool_exchange import ToolExchange

log = logging.getLogger("kvchat.chat")
SetStatus = Callable[[str, SessionStatus], Awaitable[None]]


class TurnPath:
    """The chat service's turns: what a customer message starts, and the bot's turn to its stored reply."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        engine: EngineClient,
        context: ContextService,
        hub: SessionHub,
        desk: AgentDesk,
        turns: Turns,
        set_status: SetStatus,
        reply: ReplyConfig,
        metrics: Metrics | None = None,
        commit_delay_s: float = 0.0,
        *,
        submit_concurrency: int,
    ) -> None:
        self._sm = sessionmaker
        self._engine = engine
        self._context = context
        self._hub = hub
        self._desk = desk
        self._turns = turns
        self._set_status = set_status
        self.reply = reply
        self._metrics = metrics
        self._commit_delay_s = commit_delay_s  # test hook (crash tests): see store.add_assistant_message
        self._planner = TurnPlanner(context, lambda: self.budget, reply.max_tokens)
        self._messages = MessageStore(sessionmaker, context, desk, turns, reply.defaults, self._planner)
        self._gate = FairGate(submit_concurrency)  # steps 1-2, fair by tenant (KVCHAT_TURN_SUBMIT_CONCURRENCY)
        self._answerable = Answerable(engine)
        self._streamer = ReplyStreamer(engine, hub, metrics)
        self._tools = ToolTurn(engine, self._streamer, ToolCaller(sessionmaker, reply.tools_allow_private_networks))

    @property
    def budget(self) -> int:
        """Prompt tokens a turn may use: the engine's limit (its context or its KV pool) minus the reply."""
        return self._engine.prompt_limit - self.reply.max_tokens

    # ------------------------------------------------------------------ submit: steps 1-5

    async def submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        """Steps 1 to 5; returns once the message is stored and its turn queued (the reply streams in a task). On
        SQLite the turn's reads (rows by key) run on the loop's thread (``reads_inline``; the turn's task inherits
        it)."""
        with reads_inline():
            await self._submit(tenant, session_id, frame, reply_to)

    async def _submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        marks = TurnMarks(time.perf_counter())
        if not self._gate.full:  # 0: beside 1-2 (when the message waits for the gate, its plan encodes it anyway)
            self._context.prefetch(tenant.id, frame.text)
        async with self._gate.hold(tenant.id):  # NOTE: one tenant's burst must not queue the others' messages
            await self._answerable.check(tenant.id, _prefix_text(tenant), frame.text, self.budget)  # 1
            stored = await self._messages.store(tenant.id, session_id, frame)  # 2
        marks.mark("stored")
        message = stored.message
        reply_to(MessageAck(client_msg_id=frame.client_msg_id, seq=message.seq, duplicate=stored.duplicate))  # 3
        if self._metrics is not None and not stored.duplicate:
            self._metrics.messages.labels(MessageRole.USER.value).inc()
        if stored.reply is not None:
            reply_to(_completed_from_stored(frame.client_msg_id, stored.reply))
            return
        if self._turns.get(session_id, frame.client_msg_id) is not None:
            return  # attached: this socket already receives the session's deltas
        status = stored.before if stored.duplicate else await self._after_customer_message(stored)  # 4
        if status == SessionStatus.BOT_ACTIVE:  # 5
            turn = Turn(
                session_id,
                tenant.id,
                frame.client_msg_id,
                message.seq,
                stored.context,
                message=message,
                setup=stored.setup,
                handoff=stored.handoff,
                observe=not stored.duplicate,
                read_again=stored.read_again,
                marks=marks,
                planned=stored.planned,
            )
            self._turns.start(turn, self._run)
            return
        drop(stored.planned)  # (no bot turn: a hand-off)
        if status == stored.before:
            # NOTE: tell the sender no bot reply is coming (a status change was already published to everyone).
            reply_to(SessionStatusFrame(session_id=session_id, status=status.value))
            if status in WAITING and not stored.duplicate:
                await self._observe_only(stored)
                await self._desk.customer_wrote(tenant.id, message, status)

    async def _after_customer_message(self, stored: Stored) -> SessionStatus:
        status, session_id = stored.before, stored.message.session_id
        if status == SessionStatus.RESOLVED:
            status = SessionStatus.BOT_ACTIVE  # a customer reply reopens a resolved session
            await self._set_status(session_id, status)
        if status == SessionStatus.BOT_ACTIVE and asks_for_human(stored.message.content):
            await self._observe_only(stored)  # (no bot turn observes it)
            status = await self._desk.handoff(session_id, HandoffReason.CUSTOMER_ASKED)
        return status

    async def _observe_only(self, stored: Stored) -> None:
        """A message no bot turn answers: its topic and blocks stored now (a failure costs nothing else)."""
        try:
            observation = await self._context.observe_customer(stored.context, stored.message)
        except Exception:
            log.exception("the context layer failed on message %s/%d", stored.context.session_id, stored.message.seq)
            return
        self._announce_topic(stored.message, observation)

    # ------------------------------------------------------------------ the turn: steps 6-10

    async def _run(self, turn: Turn) -> None:
        """The whole turn; whatever fails, the session hears of it (an ``error`` frame) instead of waiting."""
        try:
            await self._generate_and_store(turn)
        except Exception:
            # NOTE: a bug or a database outage must not leave the customer waiting for a reply that never comes.
            log.exception("turn %s/%s failed", turn.session_id, turn.client_msg_id)
            error = ErrorFrame(
                code="internal_error", message="the reply failed; please retry", client_msg_id=turn.client_msg_id
            )
            self._hub.publish(turn.session_id, error)
        settings = turn.handoff or await self._desk.handoff_settings(turn.tenant_id)
        await self._desk.after_bot_turn(settings, turn.session_id, turn.user_seq)  # 10

    async def _generate_and_store(self, turn: Turn) -> None:
        finished: RequestFinished | None = None
        exchange: ToolExchange | None = None
        bookkeeping: asyncio.Task[None] | None = None
        turn.marks.mark("started")
        try:
            if turn.read_again or turn.context is None:  # 6
                turn.context, turn.setup = await with_db_retry(
                    self._sm, f"reading the context of {turn.session_id}", functools.partial(self._read, turn)
                )
            setup = turn.setup or ReplySetup(self.reply.defaults)
            plan, grounding = await (turn.planned or run_cpu(turn.tenant_id, self._plan, turn, setup))  # 7
            turn.marks.mark("planned")
            self._start(turn, plan, grounding)
            await self._free_dropped(turn, plan)
            bookkeeping = asyncio.create_task(self._bookkeeping(turn, plan), name=f"bookkeeping-{turn.request_id}")
            # NOTE: checked after the awaits above too: a cancel or a drain may arrive meanwhile
            if not (turn.cancelled or turn.interrupted):
                finished, exchange = await self._generate(turn, plan, setup)  # 8
        except EngineError as exc:
            self._streamer.settle(turn)  # (before the error: what the guard held back was said before it)
            self._hub.publish(turn.session_id, _error_frame(exc, turn.client_msg_id))
            await _settled(bookkeeping)
            if turn.parts:
                await self._store(turn, MessageStatus.INCOMPLETE, "error", None)
            return
        except asyncio.CancelledError:
            # NOTE: shutdown: keep what was said, marked incomplete, then let the cancellation proceed.
            await _settled(bookkeeping)
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", None)
            raise
        await _settled(bookkeeping)  # 9
        if turn.interrupted:
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", finished)
        elif finished is None or finished.finish_reason == FinishReason.ABORTED:
            await self._store(turn, MessageStatus.CANCELLED, "cancelled", finished)
        else:
            await self._store(turn, MessageStatus.COMPLETE, finished.finish_reason.value, finished, exchange)

    async def _read(self, turn: Turn, db: AsyncSession) -> tuple[SessionContext, ReplySetup]:
        """Step 6's read again (read only: safe to retry): the context and the reply setup."""
        return await self._messages.read(db, turn.tenant_id, turn.session_id)

    def _plan(self, turn: Turn, setup: ReplySetup) -> Planned:
        """Step 7, in a worker thread, when step 2 did not start it (``turn_plan.py``)."""
        assert turn.context is not None  # (step 6)
        message = turn.message or next(m for m in turn.context.messages if m.seq == turn.user_seq)
        return self._planner.plan(turn.context, message, setup, turn.observe)

    def _start(self, turn: Turn, plan: Plan, grounding: Grounding) -> None:
        """What the plan tells the turn and the session: its context, namespace, topic and guard; a topic shift."""
        prepared = plan.prepared
        turn.context, turn.namespace = plan.context, prepared.namespace
        turn.topic = Topic(epoch=prepared.epoch, temperature=prepared.temperature, section=list(prepared.sections))
        turn.guard = ContactGuard(grounding, functools.partial(self._blocked, turn))
        if plan.observation is not None and turn.message is not None:
            self._announce_topic(turn.message, plan.observation)

    def _announce_topic(self, message: Message, observation: Observation) -> None:
        """A topic shift, to every socket of the session."""
        update = observation.update
        if update.shift:
            topic = Topic(epoch=update.epoch, temperature=update.temperature)
            frame = SessionTopicFrame(session_id=message.session_id, seq=message.seq, topic=topic)
            self._hub.publish(message.session_id, frame)

    def _blocked(self, turn: Turn, kind: ContactKind) -> None:
        log.info("turn %s/%s: an invented %s was left out of the reply", turn.session_id, turn.client_msg_id, kind)
        if self._metrics is not None:
            self._metrics.contacts_blocked.labels(kind.value).inc()

    async def _free_dropped(self, turn: Turn, plan: Plan) -> None:
        """When the prompt dropped an epoch the session's previous prompt had, free those cached blocks first.

        NOTE: before the prompt goes to the engine, not beside it: invalidating a session from a position on also
        unpublishes the blocks its requests in flight hold, and this turn's blocks would never be cached. Only a turn
        that drops an epoch waits for it; a failure is logged and the turn goes on (unfreed blocks age out)."""
        position = self._context.dropped_from(turn.session_id, plan.prepared)
        if position is None:
            return
        try:
            freed = await self._context.invalidate(
                turn.tenant_id,
                turn.session_id,
                position,
                InvalidationReason.EPOCH_DROPPED,
                SYSTEM_ACTOR,
                plan.prepared.namespace,
            )
        except Exception:
            log.exception("invalidating the dropped context of %s failed", turn.session_id)
            return
        log.info("session %s dropped an epoch: %d cached blocks freed", turn.session_id, freed.blocks_freed)

    async def _bookkeeping(self, turn: Turn, plan: Plan) -> None:
        """Step 8's task, beside the prefill: the message's blocks and topic row stored, the engine's temperature hint.
        NOTE: bookkeeping: a failure is logged, the reply goes on (the message joins the history unsplit)."""
        if plan.observation is None or turn.message is None:
            return
        try:
            turn.context = await self._context.record_customer(plan.context, turn.message, plan.observation)
        except Exception:
            log.exception("the context layer failed on message %s/%d", turn.session_id, turn.user_seq)

    async def _generate(
        self, turn: Turn, plan: Plan, setup: ReplySetup
    ) -> tuple[RequestFinished | None, ToolExchange | None]:
        """Step 8: the reply streamed as it comes, or, with tools offered, through the tool turn."""
        # NOTE: no await between the caller's check of ``turn.cancelled`` and the stream (``ReplyStreamer.stream``).
        prepared = plan.prepared
        if setup.offers_tools:
            family = self._context.tool_family
            result = await self._tools.run(
                turn, prepared.sent, prepared.tokenized, setup, family, self.reply.max_tokens, self.budget
            )
            return result.finished, result.exchange
        params = setup.settings.params(self.reply.max_tokens)
        return (await self._streamer.stream(turn, prepared.tokenized, params)).finished, None

    async def _store(
        self,
        turn: Turn,
        status: MessageStatus,
        finish_reason: str,
        finished: RequestFinished | None,
        exchange: ToolExchange | None = None,
    ) -> None:
        """Step 9: the reply stored (retried through a database blip), its blocks, then its completion published."""
        self._streamer.settle(turn)  # NOTE: first: the stored reply is what was shown, the guard's held tail too
        s = finished.stats if finished else None
        usage = store.TokenUsage(
            prompt_tokens=s.prompt_tokens if s else 0,
            completion_tokens=s.completion_tokens if s else 0,
            cached_tokens=s.cached_tokens if s else 0,
        )
        # NOTE: a commit whose answer was lost may have landed; the retry then gets that reply back, not a second one
        # (``add_assistant_message`` keeps one reply per message).
        message = await with_db_retry(
            self._sm,
            f"storing the reply of {turn.session_id}/{turn.client_msg_id}",
            lambda db: store.add_assistant_message(
                db,
                turn.session_id,
                turn.user_seq,
                turn.text,
                status,
                usage,
                self._commit_delay_s,
                exchange.to_json() if exchange is not None else None,
            ),
        )
        if self._metrics is not None:
            self._metrics.messages.labels(MessageRole.ASSISTANT.value).inc()
        # NOTE: before the completion goes out, so a client that saw it finds the reply's blocks stored too.
        await self._observe_reply(turn, message)
        usage_out = None
        if s is not None:
            usage_out = Usage(
                prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens,
                prefilled_tokens=s.prefilled_tokens,
                completion_tokens=s.completion_tokens,
                ttft_ms=round(s.ttft_s * 1000, 2),
                steps_ms=turn.marks.steps_ms(),
            )
        completed = MessageCompleted(
            client_msg_id=turn.client_msg_id,
            seq=message.seq,
            text=message.content,
            status=message.status,
            finish_reason=finish_reason,
            usage=usage_out,
            topic=turn.topic,
        )
        self._hub.publish(turn.session_id, completed)

    async def _observe_reply(self, turn: Turn, message: Message) -> None:
        if turn.context is None or turn.topic is None:
            return  # (the turn failed before its prompt; the next turn's context holds the reply, unsplit)
        try:
            await self._context.observe_reply(turn.context, message, turn.topic.epoch)
        except Exception:  # NOTE: as for the customer's message: the reply is stored either way; its blocks are extra
            log.exception("the context layer failed on reply %s/%d", turn.session_id, message.seq)


async def _settled(task: asyncio.Task[None] | None) -> None:
    """Wait for the bookkeeping (it logs its own failures)."""
    if task is not None:
        await asyncio.shield(task)  # (a cancelled turn still lets its writes finish)


def _prefix_text(tenant: Tenant) -> str:
    """The text of the tenant's part 1 (system prompt and policy), as the context builder renders it."""
    return "".join(s.text for s in prefix_segments(tenant.system_prompt, tenant.policy_text))


def _completed_from_stored(client_msg_id: str, reply: Message) -> MessageCompleted:
    return MessageCompleted(
        client_msg_id=client_msg_id,
        seq=reply.seq,
        text=reply.content,
        status=reply.status,
        finish_reason="replayed",
        usage=None,
    )


def _error_frame(exc: EngineError, client_msg_id: str | None) -> ErrorFrame:
    retry = int(exc.retry_after_s * 1000) if isinstance(exc, EngineBusy) else None
    return ErrorFrame(code=engine_error_code(exc), message=str(exc), retry_after_ms=retry, client_msg_id=client_msg_id)
