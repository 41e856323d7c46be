"""The chat service owns a turn: persist the user message, decide whether the bot answers, stream the reply from
the engine to every socket of the session, persist the reply — exactly once per ``client_msg_id``.

Turn semantics:
* the user message is committed before generation starts;
* a retried ``client_msg_id`` never creates a second message or reply: the stored reply is replayed, or the retry
  attaches to the reply in flight (its socket is subscribed to the session and sees the remaining deltas);
* a reply keeps generating when the socket drops (the customer sees it on reconnect); a cancelled reply is stored as
  ``cancelled``, one cut short by shutdown or an engine failure as ``incomplete`` — never silently dropped;
* turns of one session run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.hub import Send, SessionHub
from backend.chat.prompt import ChatMessage, asks_for_human, build_prompt
from backend.chat.protocol import (
    ErrorFrame,
    Hello,
    InFlight,
    MessageAck,
    MessageCompleted,
    MessageDelta,
    MessageOut,
    SessionStatusFrame,
    Usage,
    UserMessage,
    Welcome,
)
from backend.core.errors import SessionClosedError, engine_error_code
from backend.db.models import Message, MessageRole, MessageStatus, SessionStatus, Tenant
from backend.services import sessions as store
from engine.errors import EngineBusy, EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams

log = logging.getLogger("kvchat.chat")


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass(slots=True, eq=False)
class Turn:
    session_id: str
    tenant_id: str
    system_prompt: str
    client_msg_id: str
    user_seq: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    parts: list[str] = field(default_factory=list)
    cancelled: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def message_out(m: Message) -> MessageOut:
    return MessageOut(
        seq=m.seq,
        role=m.role,
        content=m.content,
        status=m.status,
        client_msg_id=m.client_msg_id,
        reply_to_seq=m.reply_to_seq,
        created_at=m.created_at,
    )


def _conversation_order(m: Message) -> float:
    # NOTE: a reply's seq can be later than a following user message (the customer typed while the bot answered);
    # in the prompt the reply belongs right after the message it answers.
    return m.reply_to_seq + 0.5 if m.reply_to_seq is not None else float(m.seq)


class ChatService:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        engine: LLMEngine,
        hub: SessionHub,
        reply: ReplyConfig | None = None,
    ) -> None:
        self._sm = self.sessionmaker = sessionmaker
        self._engine = engine
        self.hub = hub
        self.reply = reply or ReplyConfig()
        self._turns: dict[tuple[str, str], Turn] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # turns of a session run one at a time
        self._submit_locks: dict[str, asyncio.Lock] = {}

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
            last_seq = max((m.seq for m in missed), default=hello.last_seq)
        in_flight = self._in_flight(session.id)
        return Welcome(
            session_id=session.id,
            status=session.status,
            messages=[message_out(m) for m in missed],
            last_seq=last_seq,
            in_flight=InFlight(client_msg_id=in_flight.client_msg_id, text=in_flight.text) if in_flight else None,
        )

    def _in_flight(self, session_id: str) -> Turn | None:
        return next((t for (sid, _), t in self._turns.items() if sid == session_id), None)

    async def set_status(self, session_id: str, status: SessionStatus) -> None:
        async with self._sm() as db:
            await store.set_status(db, session_id, status)
        self.hub.publish(session_id, SessionStatusFrame(session_id=session_id, status=status.value))
        if status == SessionStatus.CLOSED:
            self.release_cache(session_id)

    def release_cache(self, session_id: str) -> None:
        self._locks.pop(session_id, None)  # a closed or deleted session starts no more turns
        self._submit_locks.pop(session_id, None)
        freed = self._engine.release_session(session_id)
        log.info("released the engine cache of session %s (%d blocks)", session_id, freed)

    async def close_idle(self, idle_for: timedelta) -> list[str]:
        """Close sessions without activity for ``idle_for`` (and release their engine cache)."""
        async with self._sm() as db:
            ids = await store.idle_session_ids(db, idle_for)
        for session_id in ids:
            if self._in_flight(session_id) is None:
                await self.set_status(session_id, SessionStatus.CLOSED)
        return ids

    # ------------------------------------------------------------------ turns

    async def submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        """Handle one ``user.message``; returns once the message is stored (the reply streams in the background)."""
        # NOTE: one submit per session at a time, so a retried client_msg_id racing its original (another socket of
        # the same session) sees the turn the original started instead of starting a second one.
        async with self._submit_locks.setdefault(session_id, asyncio.Lock()):
            await self._submit(tenant, session_id, frame, reply_to)

    async def _submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        async with self._sm() as db:
            session = await store.get_session(db, tenant.id, session_id)
            if session.status == SessionStatus.CLOSED.value:
                raise SessionClosedError("this session is closed; start a new one")
            message, duplicate = await store.add_user_message(db, session_id, frame.client_msg_id, frame.text)
            reply = await store.find_reply(db, session_id, message.seq) if duplicate else None
        reply_to(MessageAck(client_msg_id=frame.client_msg_id, seq=message.seq, duplicate=duplicate))
        if reply is not None:
            reply_to(_completed_from_stored(frame.client_msg_id, reply))
            return
        if (session_id, frame.client_msg_id) in self._turns:
            return  # attached: this socket already receives the session's deltas
        before = SessionStatus(session.status)
        status = before if duplicate else await self._after_customer_message(session_id, before, frame.text)
        if status == SessionStatus.BOT_ACTIVE:
            self._start_turn(Turn(session_id, tenant.id, tenant.system_prompt, frame.client_msg_id, message.seq))
        elif status == before:
            # NOTE: tell the sender no bot reply is coming (a status change was already published to everyone).
            reply_to(SessionStatusFrame(session_id=session_id, status=status.value))

    async def _after_customer_message(self, session_id: str, status: SessionStatus, text: str) -> SessionStatus:
        if status == SessionStatus.RESOLVED:
            status = SessionStatus.BOT_ACTIVE  # a customer reply reopens a resolved session
            await self.set_status(session_id, status)
        if status == SessionStatus.BOT_ACTIVE and asks_for_human(text):
            status = SessionStatus.AGENT_REQUESTED
            await self.set_status(session_id, status)
        return status

    def cancel(self, session_id: str, client_msg_id: str | None) -> bool:
        turn = self._turns.get((session_id, client_msg_id)) if client_msg_id else self._in_flight(session_id)
        if turn is None:
            return False
        turn.cancelled = True
        self._engine.abort(turn.request_id)
        return True

    def _start_turn(self, turn: Turn) -> None:
        self._turns[(turn.session_id, turn.client_msg_id)] = turn
        turn.task = asyncio.create_task(self._run_turn(turn), name=f"turn-{turn.session_id}-{turn.client_msg_id}")

    async def _run_turn(self, turn: Turn) -> None:
        lock = self._locks.setdefault(turn.session_id, asyncio.Lock())
        try:
            async with lock:
                await self._generate_and_store(turn)
        except Exception:
            # NOTE: a bug or a database outage must not leave the customer waiting for a reply that never comes.
            log.exception("turn %s/%s failed", turn.session_id, turn.client_msg_id)
            self.hub.publish(
                turn.session_id,
                ErrorFrame(
                    code="internal_error", message="the reply failed; please retry", client_msg_id=turn.client_msg_id
                ),
            )
        finally:
            self._turns.pop((turn.session_id, turn.client_msg_id), None)

    async def _generate_and_store(self, turn: Turn) -> None:
        finished: RequestFinished | None = None
        try:
            prompt = await self._prompt(turn)
            if not turn.cancelled:  # NOTE: checked after the awaits above too: a cancel may arrive meanwhile
                finished = await self._generate(turn, prompt)
        except EngineError as exc:
            self.hub.publish(turn.session_id, _error_frame(exc, turn.client_msg_id))
            if turn.parts:
                await self._store(turn, MessageStatus.INCOMPLETE, "error", None)
            return
        except asyncio.CancelledError:
            # NOTE: shutdown: keep what was said, marked incomplete, then let the cancellation proceed.
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", None)
            raise
        if finished is None or finished.finish_reason == FinishReason.ABORTED:
            await self._store(turn, MessageStatus.CANCELLED, "cancelled", finished)
        else:
            await self._store(turn, MessageStatus.COMPLETE, finished.finish_reason.value, finished)

    async def _prompt(self, turn: Turn) -> list[ChatMessage]:
        async with self._sm() as db:
            everything = await store.messages_after(db, turn.session_id, 0)
        history = sorted(
            (
                m
                for m in everything
                if (m.role == MessageRole.USER.value and m.seq <= turn.user_seq)
                or (m.role == MessageRole.ASSISTANT.value and (m.reply_to_seq or 0) < turn.user_seq)
            ),
            key=_conversation_order,
        )
        info = self._engine.info
        # NOTE: the engine refuses prompts larger than its KV pool too, not only beyond the model's context.
        budget = min(info.max_model_len, info.num_blocks * info.block_size) - self.reply.max_tokens
        return build_prompt(turn.system_prompt, history, lambda msgs: len(self._engine.tokenize(msgs)), budget)

    async def _generate(self, turn: Turn, prompt: list[ChatMessage]) -> RequestFinished | None:
        params = SamplingParams(
            max_tokens=self.reply.max_tokens, temperature=self.reply.temperature, top_p=self.reply.top_p
        )
        finished: RequestFinished | None = None
        stream = self._engine.generate(
            prompt, params, namespace=turn.tenant_id, request_id=turn.request_id, session=turn.session_id
        )
        async with aclosing(stream):
            async for event in stream:
                if isinstance(event, TokenDelta):
                    # NOTE: a model can emit NUL, which Postgres text cannot store; what is streamed is what is stored.
                    text = event.text.replace("\x00", "")
                    if text:
                        turn.parts.append(text)
                        self.hub.publish(turn.session_id, MessageDelta(client_msg_id=turn.client_msg_id, text=text))
                else:
                    finished = event
        return finished

    async def _store(
        self, turn: Turn, status: MessageStatus, finish_reason: str, finished: RequestFinished | None
    ) -> None:
        s = finished.stats if finished else None
        usage = store.TokenUsage(
            prompt_tokens=s.prompt_tokens if s else 0,
            completion_tokens=s.completion_tokens if s else 0,
            cached_tokens=s.cached_tokens if s else 0,
        )
        async with self._sm() as db:
            message = await store.add_assistant_message(db, turn.session_id, turn.user_seq, turn.text, status, usage)
        self.hub.publish(
            turn.session_id,
            MessageCompleted(
                client_msg_id=turn.client_msg_id,
                seq=message.seq,
                text=message.content,
                status=status.value,
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
            ),
        )

    async def shutdown(self) -> None:
        """Cancel turns in flight; each stores what it had as ``incomplete``."""
        tasks = [t.task for t in self._turns.values() if t.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_idle(self) -> None:
        """Wait for every turn in flight to finish (tests, graceful drains)."""
        while self._turns:
            tasks = [t.task for t in self._turns.values() if t.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)


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
