"""One bot turn, from the session's context to the stored reply (``backend/chat/service.py`` decides that a turn
runs; ``backend/chat/turns.py`` runs them, one at a time per session).

The steps: the reply setup (the tenant's reply settings and tools, ``reply_setup.py``), the context (read once: the
one its customer message was observed with, while nothing was stored since), the prompt (built and tokenized once,
off the event loop, with the tools offered) and the reply's contact guard (grounded in the same context:
``grounding.py``), the blocks an epoch drop left behind freed, the reply streamed from the
engine to every socket of the session (``reply_stream.py``; with tools, ``tool_turn.py``), then stored with its
blocks and tool calls, then the completion published.
A reply is stored whatever happens: ``complete``, ``cancelled``, or ``incomplete`` (an engine error after some text,
a shutdown) with exactly the text that was published.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat import reply_setup
from backend.chat.grounding import turn_grounding
from backend.chat.hub import SessionHub
from backend.chat.protocol import ErrorFrame, MessageCompleted, Topic, Usage
from backend.chat.reply_setup import ReplySetup
from backend.chat.reply_stream import ReplyStreamer
from backend.chat.tool_turn import RESULT_RESERVE_TOKENS, ToolTurn
from backend.chat.turn_state import Turn
from backend.context.contact_guard import ContactGuard
from backend.context.contacts import ContactKind
from backend.core.errors import engine_error_code
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.db.models import Message
from backend.domain import MessageRole, MessageStatus
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import EngineBusy, EngineError, FinishReason, RequestFinished
from backend.services import sessions as store
from backend.services.context_service import ContextService, PreparedPrompt
from backend.services.reply_settings import ReplySettings
from backend.services.tool_calls import ToolCaller
from backend.services.tool_exchange import ToolExchange

log = logging.getLogger("kvchat.chat")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    """The server's reply settings: the reply's length, how tenants without settings of their own sample
    (``KVCHAT_REPLY_*``; a tenant's own: ``/admin/tenant/reply-settings``), and whether tenants' tools may be on
    loopback or private addresses (``KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS``)."""

    max_tokens: int = 256
    defaults: ReplySettings = field(default_factory=ReplySettings)
    tools_allow_private_networks: bool = False


class TurnRunner:
    """Runs turns; shares the chat service's database, engine, context layer and hub."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        engine: EngineClient,
        context: ContextService,
        hub: SessionHub,
        reply: ReplyConfig,
        metrics: Metrics | None = None,
        commit_delay_s: float = 0.0,
    ) -> None:
        self._sm = sessionmaker
        self._engine = engine
        self._context = context
        self._hub = hub
        self.reply = reply
        self._metrics = metrics
        self._commit_delay_s = commit_delay_s  # test hook (crash tests): see store.add_assistant_message
        self._streamer = ReplyStreamer(engine, hub, metrics)
        caller = ToolCaller(sessionmaker, reply.tools_allow_private_networks)
        self._tools = ToolTurn(engine, self._streamer, caller)

    @property
    def budget(self) -> int:
        """Prompt tokens a turn may use: the engine's limit (its context or its KV pool) minus the reply."""
        return self._engine.prompt_limit - self.reply.max_tokens

    async def run(self, turn: Turn) -> None:
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

    async def _generate_and_store(self, turn: Turn) -> None:
        finished: RequestFinished | None = None
        exchange: ToolExchange | None = None
        try:
            setup = await with_db_retry(
                self._sm,
                f"reading the reply settings of {turn.tenant_id}",
                lambda db: reply_setup.load(db, turn.tenant_id, self.reply.defaults),
            )
            prepared = await self._prompt(turn, setup)
            # NOTE: checked after the awaits above too: a cancel or a drain may arrive meanwhile
            if not (turn.cancelled or turn.interrupted):
                finished, exchange = await self._generate(turn, prepared, setup)
        except EngineError as exc:
            self._streamer.settle(turn)  # (before the error: what the guard held back was said before it)
            self._hub.publish(turn.session_id, _error_frame(exc, turn.client_msg_id))
            if turn.parts:
                await self._store(turn, MessageStatus.INCOMPLETE, "error", None)
            return
        except asyncio.CancelledError:
            # NOTE: shutdown: keep what was said, marked incomplete, then let the cancellation proceed.
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", None)
            raise
        if turn.interrupted:
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", finished)
        elif finished is None or finished.finish_reason == FinishReason.ABORTED:
            await self._store(turn, MessageStatus.CANCELLED, "cancelled", finished)
        else:
            await self._store(turn, MessageStatus.COMPLETE, finished.finish_reason.value, finished, exchange)

    async def _prompt(self, turn: Turn, setup: ReplySetup) -> PreparedPrompt:
        """The turn's prompt from the context builder (built and tokenized off the loop, the tenant's tools offered);
        frees what it dropped."""
        if turn.context is None or not self._context.is_current(turn.context):
            turn.context = await with_db_retry(
                self._sm,
                f"reading the context of {turn.session_id}",
                lambda db: self._context.load(db, turn.tenant_id, turn.session_id),
            )
        budget, tools = self.budget, tuple(t.spec() for t in setup.tools)
        if tools:  # NOTE: room for the calls and their results, without leaving the history nothing
            budget = max(budget // 2, budget - self.reply.max_tokens - RESULT_RESERVE_TOKENS)
        # NOTE: runs in a worker thread: a long history is tokenized several times while the budget is searched.
        prepared = await run_cpu(turn.tenant_id, self._context.prepare, turn.context, turn.user_seq, budget, tools)
        turn.namespace = prepared.namespace
        turn.topic = Topic(epoch=prepared.epoch, temperature=prepared.temperature, section=list(prepared.sections))
        turn.guard = ContactGuard(turn_grounding(turn.context), functools.partial(self._blocked, turn))
        await self._invalidate_dropped(turn, prepared)
        return prepared

    def _blocked(self, turn: Turn, kind: ContactKind) -> None:
        log.info("turn %s/%s: an invented %s was left out of the reply", turn.session_id, turn.client_msg_id, kind)
        if self._metrics is not None:
            self._metrics.contacts_blocked.labels(kind.value).inc()

    async def _invalidate_dropped(self, turn: Turn, prepared: PreparedPrompt) -> None:
        try:
            freed = await self._context.invalidate_dropped(turn.tenant_id, turn.session_id, prepared)
        except Exception:  # NOTE: the context layer is bookkeeping: unfreed blocks age out; the turn goes on
            log.exception("invalidating the dropped context of %s failed", turn.session_id)
            return
        if freed is not None:
            log.info("session %s dropped an epoch: %d cached blocks freed", turn.session_id, freed.blocks_freed)

    async def _generate(
        self, turn: Turn, prepared: PreparedPrompt, setup: ReplySetup
    ) -> tuple[RequestFinished | None, ToolExchange | None]:
        """The reply: streamed as it comes, or, with tools offered, through the tool turn."""
        # NOTE: no await between the caller's check of ``turn.cancelled`` and the stream (``ReplyStreamer.stream``).
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
        self._streamer.settle(turn)  # NOTE: first: the stored reply is what was shown, the guard's held tail too
        s = finished.stats if finished else None
        usage = store.TokenUsage(
            prompt_tokens=s.prompt_tokens if s else 0,
            completion_tokens=s.completion_tokens if s else 0,
            cached_tokens=s.cached_tokens if s else 0,
        )
        message = await self._persist_reply(turn, status, usage, exchange)
        # NOTE: before the completion goes out, so a client that saw it finds the reply's blocks stored too.
        await self._observe_reply(turn, message)
        self._hub.publish(
            turn.session_id,
            MessageCompleted(
                client_msg_id=turn.client_msg_id,
                seq=message.seq,
                text=message.content,
                status=message.status,
                finish_reason=finish_reason,
                usage=Usage(
                    prompt_tokens=s.prompt_tokens,
                    cached_tokens=s.cached_tokens,
                    prefilled_tokens=s.prefilled_tokens,
                    completion_tokens=s.completion_tokens,
                    ttft_ms=round(s.ttft_s * 1000, 2),
                )
                if s
                else None,
                topic=turn.topic,
            ),
        )

    async def _observe_reply(self, turn: Turn, message: Message) -> None:
        if turn.context is None:
            return  # (no context was read: the turn failed before its prompt; the next turn's reads the reply)
        epoch = turn.topic.epoch if turn.topic is not None else 0
        try:
            await self._context.observe_reply(turn.context, message, epoch)
        except Exception:  # NOTE: as for the customer's message: the reply is stored either way; its blocks are extra
            log.exception("the context layer failed on reply %s/%d", turn.session_id, message.seq)

    async def _persist_reply(
        self, turn: Turn, status: MessageStatus, usage: store.TokenUsage, exchange: ToolExchange | None
    ) -> Message:
        """Store the reply (retried through a database blip, so a generated reply is not lost to it).

        NOTE: a commit whose answer was lost may have landed; the retry then gets that reply back, not a second one
        (``add_assistant_message`` keeps one reply per message).
        """
        reply = await with_db_retry(
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
        self._context.changed(turn.session_id)
        if self._metrics is not None:
            self._metrics.messages.labels(MessageRole.ASSISTANT.value).inc()
        return reply


async def with_db_retry(
    sessionmaker: async_sessionmaker[AsyncSession], what: str, step: Callable[[AsyncSession], Awaitable[T]]
) -> T:
    """Run ``step`` in a short DB session; when the database went away (a restart, a failover), try again for a few
    seconds. ``step`` must be safe to repeat. A constraint violation is no blip: it is raised at once."""
    for pause in (*_DB_RETRY_PAUSES_S, None):
        try:
            async with sessionmaker() as db:
                return await step(db)
        except IntegrityError:
            raise
        except (DBAPIError, OSError):
            if pause is None:
                raise
            log.warning("%s failed on the database; retrying in %.2fs", what, pause)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable: the last attempt returns or raises")


_DB_RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # ~8 s: a Postgres restart or failover


def _error_frame(exc: EngineError, client_msg_id: str | None) -> ErrorFrame:
    retry = int(exc.retry_after_s * 1000) if isinstance(exc, EngineBusy) else None
    return ErrorFrame(code=engine_error_code(exc), message=str(exc), retry_after_ms=retry, client_msg_id=client_msg_id)
