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
* turns of one session run one at a time, in order; tokenizing runs in a worker thread, off the event loop;
* the context layer (``backend/services/context_service.py``) splits every stored message into blocks and moves the
  session's topic; the prompt is the context builder's, under the tenant's history policy; when it drops an epoch the
  previous prompt had, the engine frees those cached blocks. A failure there never costs the customer the reply.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.hub import Send, SessionHub
from backend.chat.prompt import ChatMessage, asks_for_human
from backend.chat.protocol import (
    ErrorFrame,
    Hello,
    InFlight,
    MessageAck,
    MessageCompleted,
    MessageDelta,
    MessageOut,
    SessionStatusFrame,
    SessionTopicFrame,
    Topic,
    Usage,
    UserMessage,
    Welcome,
)
from backend.context.builder import prefix_segments
from backend.core.errors import MessageTooLongError, SessionClosedError, ShuttingDownError, engine_error_code
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.db.models import Message, Tenant
from backend.domain import InvalidationReason, MessageRole, MessageStatus, SessionStatus
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    EngineBusy,
    EngineError,
    ErasureResult,
    FinishReason,
    RequestFinished,
    SamplingParams,
    TokenDelta,
    TokenizedPrompt,
)
from backend.services import sessions as store
from backend.services.context_service import SYSTEM_ACTOR, ContextService, PreparedPrompt
from backend.services.key_lookup import KeyLookup

log = logging.getLogger("kvchat.chat")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What ``drain`` did: turns that finished within the grace period, and turns it cut off."""

    finished: int
    cut_off: int


@dataclass(slots=True, eq=False)
class Turn:
    session_id: str
    tenant_id: str
    client_msg_id: str
    user_seq: int
    namespace: str = ""  # the tenant's cache namespace, read with the turn's context (backend/core/namespaces.py)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    parts: list[str] = field(default_factory=list)
    cancelled: bool = False
    interrupted: bool = False  # cut off by shutdown: stored incomplete
    task: asyncio.Task[None] | None = None
    topic: Topic | None = None  # the topic of the message it answers (known once the prompt is built)

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
        self.reply = reply or ReplyConfig()
        self._metrics = metrics
        self._commit_delay_s = commit_delay_s  # test hook (crash tests): see store.add_assistant_message
        self._turns: dict[tuple[str, str], Turn] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # turns of a session run one at a time
        self._submit_locks: dict[str, asyncio.Lock] = {}
        self._accepting = True
        self._cutting_off = False  # the drain's grace period is over: a turn that starts now is cut off at once
        self._submitting = 0

    @property
    def block_size(self) -> int:
        """Tokens per engine KV block."""
        return self._engine.info.block_size

    @property
    def accepting(self) -> bool:
        """False once a drain began: no new turns (``/readyz`` answers 503 then)."""
        return self._accepting

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
            cut_off=[
                m.reply_to_seq
                for m in missed
                if m.reply_to_seq is not None and m.status == MessageStatus.INCOMPLETE.value
            ],
            topic=Topic(epoch=session.topic_epoch, temperature=session.semantic_temperature),
        )

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

    def _in_flight(self, session_id: str) -> Turn | None:
        return next((t for (sid, _), t in self._turns.items() if sid == session_id), None)

    async def set_status(
        self,
        session_id: str,
        status: SessionStatus,
        reason: InvalidationReason = InvalidationReason.SESSION_CLOSED,
        actor: str = SYSTEM_ACTOR,
    ) -> None:
        """Store and announce ``status``; closing releases the session's engine cache (an invalidation event with
        ``reason`` and ``actor``)."""
        async with self._sm() as db:
            await store.set_status(db, session_id, status)
        self.hub.publish(session_id, SessionStatusFrame(session_id=session_id, status=status.value))
        if status == SessionStatus.CLOSED:
            freed = await self.release_cache(session_id)
            await self.context.record_release(session_id, freed, reason, actor)

    async def release_cache(self, session_id: str) -> int:
        """Release the engine cache only this session uses (demoted to disk when the engine has a disk tier);
        returns the blocks that left memory."""
        self._forget(session_id)
        freed = await asyncio.to_thread(self._engine.release_session, session_id)  # (disk writes: off the loop)
        log.info("released the engine cache of session %s (%d blocks)", session_id, freed)
        return freed

    async def erase_cache(self, session_id: str, namespace: str) -> ErasureResult:
        """Erasure (a deleted session): remove the session's blocks from every tier of the engine."""
        self._forget(session_id)
        erased = await asyncio.to_thread(self._engine.erase_session, session_id, namespace)
        log.info(
            "erased the engine cache of session %s (%d memory, %d disk blocks)",
            session_id,
            erased.memory_blocks,
            erased.disk_blocks,
        )
        return erased

    def _forget(self, session_id: str) -> None:
        self._locks.pop(session_id, None)  # a closed or deleted session starts no more turns
        self._submit_locks.pop(session_id, None)
        self.context.forget(session_id)

    async def close_idle(self, idle_for: timedelta) -> list[str]:
        """Close sessions without activity for ``idle_for`` (and release their engine cache)."""
        async with self._sm() as db:
            ids = await store.idle_session_ids(db, idle_for)
        for session_id in ids:
            if self._in_flight(session_id) is None:
                await self.set_status(session_id, SessionStatus.CLOSED, InvalidationReason.SESSION_TIMED_OUT)
        return ids

    # ------------------------------------------------------------------ turns

    async def submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        """Handle one ``user.message``; returns once the message is stored (the reply streams in the background)."""
        # NOTE: one submit per session at a time, so a retried client_msg_id racing its original (another socket of
        # the same session) sees the turn the original started instead of starting a second one.
        async with self._submit_locks.setdefault(session_id, asyncio.Lock()):
            await self._submit(tenant, session_id, frame, reply_to)

    async def _submit(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        if not self._accepting:
            raise ShuttingDownError("the server is restarting; send the message again once reconnected")
        self._submitting += 1  # NOTE: drain waits for these too, so a turn decided mid-drain is not lost
        try:
            await self._check_answerable(tenant.id, _prefix_text(tenant), frame.text)
            await self._store_and_start(tenant, session_id, frame, reply_to)
        finally:
            self._submitting -= 1

    async def _store_and_start(self, tenant: Tenant, session_id: str, frame: UserMessage, reply_to: Send) -> None:
        async with self._sm() as db:
            session = await store.get_session(db, tenant.id, session_id)
            if session.status == SessionStatus.CLOSED.value:
                raise SessionClosedError("this session is closed; start a new one")
            before = SessionStatus(session.status)
            message, duplicate = await store.add_user_message(
                db, session_id, frame.client_msg_id, frame.text, awaiting_reply=_bot_answers(before, frame.text)
            )
            reply = await store.find_reply(db, session_id, message.seq) if duplicate else None
        reply_to(MessageAck(client_msg_id=frame.client_msg_id, seq=message.seq, duplicate=duplicate))
        if self._metrics is not None and not duplicate:
            self._metrics.messages.labels(MessageRole.USER.value).inc()
        if reply is not None:
            reply_to(_completed_from_stored(frame.client_msg_id, reply))
            return
        if (session_id, frame.client_msg_id) in self._turns:
            return  # attached: this socket already receives the session's deltas
        if not duplicate:
            await self._observe_customer(tenant.id, session_id, message)
        status = before if duplicate else await self._after_customer_message(session_id, before, frame.text)
        if status == SessionStatus.BOT_ACTIVE:
            if duplicate:  # a retry restarts a turn that left no reply (busy, an error): it is owed one again
                async with self._sm() as db:
                    await store.await_reply(db, message)
            self._start_turn(Turn(session_id, tenant.id, frame.client_msg_id, message.seq))
        elif status == before:
            # NOTE: tell the sender no bot reply is coming (a status change was already published to everyone).
            reply_to(SessionStatusFrame(session_id=session_id, status=status.value))

    async def _observe_customer(self, tenant_id: str, session_id: str, message: Message) -> None:
        """Split the message, move the topic; announce a topic shift to every socket of the session."""
        try:
            update = await self.context.observe_customer(tenant_id, session_id, message)
        except Exception:
            # NOTE: the context layer is bookkeeping around the turn: when it fails, the customer still gets a reply
            # (the message joins the history unsplit, in the epoch of the message before it).
            log.exception("the context layer failed on message %s/%d", session_id, message.seq)
            return
        if update.shift:
            topic = Topic(epoch=update.epoch, temperature=update.temperature)
            self.hub.publish(session_id, SessionTopicFrame(session_id=session_id, seq=message.seq, topic=topic))

    async def _check_answerable(self, tenant_id: str, system_prompt: str, text: str) -> None:
        """Refuse a message that could never be answered: with the system prompt and a reply it exceeds the budget."""
        messages = [*_system(system_prompt), {"role": MessageRole.USER.value, "content": text}]
        floor = self._engine.prompt_token_floor(m["content"] for m in messages)
        if floor > self._budget():  # NOTE: too long by its length alone: no need to spend the CPU on tokenizing it
            raise MessageTooLongError(floor, self._budget(), at_least=True)
        tokens = len(await run_cpu(tenant_id, self._engine.tokenize, messages))
        if tokens > self._budget():
            raise MessageTooLongError(tokens, self._budget())

    def _budget(self) -> int:
        """Prompt tokens a turn may use: the engine's limit (its context or its KV pool) minus the reply."""
        return self._engine.prompt_limit - self.reply.max_tokens

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
        turn.interrupted = self._cutting_off  # (a message stored just as the grace period ended gets its marker)
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
            # NOTE: checked after the awaits above too: a cancel or a drain may arrive meanwhile
            if not (turn.cancelled or turn.interrupted):
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
        if turn.interrupted:
            await self._store(turn, MessageStatus.INCOMPLETE, "interrupted", finished)
        elif finished is None or finished.finish_reason == FinishReason.ABORTED:
            await self._store(turn, MessageStatus.CANCELLED, "cancelled", finished)
        else:
            await self._store(turn, MessageStatus.COMPLETE, finished.finish_reason.value, finished)

    async def _prompt(self, turn: Turn) -> TokenizedPrompt:
        """The turn's prompt from the context builder (built and tokenized off the loop); frees what it dropped."""
        ctx = await self._with_db_retry(
            f"reading the context of {turn.session_id}",
            lambda db: self.context.load(db, turn.tenant_id, turn.session_id),
        )
        # NOTE: runs in a worker thread: a long history is tokenized several times while the budget is searched.
        prepared = await run_cpu(turn.tenant_id, self.context.prepare, ctx, turn.user_seq, self._budget())
        turn.namespace = prepared.namespace
        turn.topic = Topic(epoch=prepared.epoch, temperature=prepared.temperature)
        await self._invalidate_dropped(turn, prepared)
        return prepared.tokenized

    async def _invalidate_dropped(self, turn: Turn, prepared: PreparedPrompt) -> None:
        try:
            freed = await self.context.invalidate_dropped(turn.tenant_id, turn.session_id, prepared)
        except Exception:  # NOTE: as for _observe_customer: unfreed blocks age out of the cache; the turn goes on
            log.exception("invalidating the dropped context of %s failed", turn.session_id)
            return
        if freed is not None:
            log.info("session %s dropped an epoch: %d cached blocks freed", turn.session_id, freed.blocks_freed)

    async def _generate(self, turn: Turn, prompt: TokenizedPrompt) -> RequestFinished | None:
        params = SamplingParams(
            max_tokens=self.reply.max_tokens, temperature=self.reply.temperature, top_p=self.reply.top_p
        )
        finished: RequestFinished | None = None
        timer = self._metrics.reply_timer(turn.tenant_id) if self._metrics is not None else None
        # NOTE: no await between the caller's check of ``turn.cancelled`` and the first step of the stream, which
        # registers the request (its prompt is tokenized: nothing to offload): an abort from then on finds it.
        stream = self._engine.generate(prompt, params, turn.namespace, turn.request_id, turn.session_id)
        async with aclosing(stream):
            async for event in stream:
                if timer is not None and isinstance(event, TokenDelta):
                    timer.delta()
                elif timer is not None and isinstance(event, RequestFinished):
                    timer.finished(event.stats)
                if isinstance(event, TokenDelta):
                    # NOTE: a model can emit NUL, which Postgres text cannot store; what is streamed is what is stored.
                    text = event.text.replace("\x00", "")
                    if text:
                        turn.parts.append(text)
                        self.hub.publish(turn.session_id, MessageDelta(client_msg_id=turn.client_msg_id, text=text))
                elif isinstance(event, RequestFinished):
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
        message = await self._persist_reply(turn, status, usage)
        # NOTE: before the completion goes out, so a client that saw it finds the reply's blocks stored too.
        await self._observe_reply(turn, message)
        self.hub.publish(
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
        epoch = turn.topic.epoch if turn.topic is not None else 0
        try:
            await self.context.observe_reply(turn.tenant_id, turn.session_id, message, epoch)
        except Exception:  # NOTE: as for _observe_customer: the reply is stored either way; its blocks are extra
            log.exception("the context layer failed on reply %s/%d", turn.session_id, message.seq)

    async def _persist_reply(self, turn: Turn, status: MessageStatus, usage: store.TokenUsage) -> Message:
        """Store the reply (retried through a database blip, so a generated reply is not lost to it).

        NOTE: a commit whose answer was lost may have landed; the retry then gets that reply back, not a second one
        (``add_assistant_message`` keeps one reply per message).
        """
        reply = await self._with_db_retry(
            f"storing the reply of {turn.session_id}/{turn.client_msg_id}",
            lambda db: store.add_assistant_message(
                db, turn.session_id, turn.user_seq, turn.text, status, usage, self._commit_delay_s
            ),
        )
        if self._metrics is not None:
            self._metrics.messages.labels(MessageRole.ASSISTANT.value).inc()
        return reply

    async def _with_db_retry(self, what: str, step: Callable[[AsyncSession], Awaitable[T]]) -> T:
        """Run ``step`` in a short DB session; when the database went away (a restart, a failover), try again for
        a few seconds. ``step`` must be safe to repeat. A constraint violation is no blip: it is raised at once."""
        for pause in (*_DB_RETRY_PAUSES_S, None):
            try:
                async with self._sm() as db:
                    return await step(db)
            except IntegrityError:
                raise
            except (DBAPIError, OSError):
                if pause is None:
                    raise
                log.warning("%s failed on the database; retrying in %.2fs", what, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def drain(self, grace_s: float) -> DrainReport:
        """Stop taking turns; give those in flight ``grace_s`` to finish while they still stream to the sockets; cut
        off the rest: each is stored ``incomplete`` with exactly the text it published. Called on shutdown, before
        the server closes the sockets (``kvchat serve``), and again by the lifespan (a no-op by then)."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        started = len(self._turns)
        await self._wait_for_turns(loop.time() + grace_s)
        self._cutting_off = True
        left = [t for t in self._turns.values() if not t.interrupted]
        for turn in left:
            turn.interrupted = True
            self._engine.abort(turn.request_id)
        if not await self._wait_for_turns(loop.time() + _STORE_TIMEOUT_S):
            tasks = [t.task for t in self._turns.values() if t.task is not None]
            for task in tasks:  # NOTE: the last resort (a database that does not answer): cancelled turns store
                task.cancel()  # what they have on the way out, if they can
            await asyncio.gather(*tasks, return_exceptions=True)
        if started:
            # NOTE: publishing only queues frames for each socket's writer task; give the writers a moment to send
            # the last deltas and completions before the server closes the sockets.
            await asyncio.sleep(_FLUSH_S)
        return DrainReport(finished=max(0, started - len(left)), cut_off=len(left))

    async def _wait_for_turns(self, deadline: float) -> bool:
        """Wait until no turn runs and no message is being stored, or ``deadline``; True when idle."""
        loop = asyncio.get_running_loop()
        while self._turns or self._submitting:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            tasks = {t.task for t in self._turns.values() if t.task is not None}
            if tasks:
                await asyncio.wait(tasks, timeout=remaining)
            else:
                await asyncio.sleep(min(0.05, remaining))
        return True

    async def wait_idle(self) -> None:
        """Wait for every turn in flight to finish (tests)."""
        while self._turns:
            tasks = [t.task for t in self._turns.values() if t.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)


_DB_RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # ~8 s: a Postgres restart or failover
_STORE_TIMEOUT_S = 15.0  # after the grace period: how long cut-off turns get to store their text
_FLUSH_S = 0.2


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


def _error_frame(exc: EngineError, client_msg_id: str | None) -> ErrorFrame:
    retry = int(exc.retry_after_s * 1000) if isinstance(exc, EngineBusy) else None
    return ErrorFrame(code=engine_error_code(exc), message=str(exc), retry_after_ms=retry, client_msg_id=client_msg_id)
