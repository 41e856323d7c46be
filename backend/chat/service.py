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
* a turn reads the session's context from the database once, in the transaction that stores its message, under the
  session's lock (read again only when another turn of the session was in flight at that read); nothing about a
  session's context is kept per process but the previous prompt (what an epoch drop frees);
* the context layer (``backend/services/context_service.py``) splits every stored message into blocks and moves the
  session's topic; the prompt is the context builder's, under the tenant's history policy; when it drops an epoch the
  previous prompt had, the engine frees those cached blocks. That bookkeeping is stored beside the prefill and
  awaited before the reply is stored; a failure there never costs the customer the reply.

The parts: this module keeps the sessions (open, status, cache, drain); ``backend/chat/turn_path.py`` is a message's
whole path, from its frame to the stored reply, top to bottom; ``backend/chat/turns.py`` keeps the turns in flight
and drains them.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.chat.agent_desk import WAITING, AgentDesk
from backend.chat.hub import Send, SessionHub
from backend.chat.protocol import (
    Hello,
    InFlight,
    MessageOut,
    SessionStatusFrame,
    Topic,
    UserMessage,
    Welcome,
)
from backend.chat.turn import ReplyConfig
from backend.chat.turn_path import TurnPath
from backend.chat.turns import DrainReport, Turns
from backend.core.agent_metrics import AgentMetrics
from backend.core.errors import ShuttingDownError
from backend.core.metrics import Metrics
from backend.db.models import Message, Tenant
from backend.domain import HandoffReason, InvalidationReason, MessageRole, MessageStatus, SessionStatus
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import ErasureResult
from backend.services import agents
from backend.services import sessions as store
from backend.services.agents import ADMIN_NAME
from backend.services.context_service import SYSTEM_ACTOR, ContextService
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
        *,
        submit_concurrency: int,  # (KVCHAT_TURN_SUBMIT_CONCURRENCY: its default is the setting's)
    ) -> None:
        self._sm = self.sessionmaker = sessionmaker
        self._engine = engine
        self.context = context
        self.hub = hub
        self.keys = KeyLookup(sessionmaker, hub.keys)  # chat tokens, looked up once per burst (hello, /v1)
        # human agents (backend/chat/agent_desk.py)
        self.desk = AgentDesk(sessionmaker, hub, AgentMetrics(metrics.registry) if metrics else None)
        self._turns = Turns(engine)
        self._path = TurnPath(
            sessionmaker,
            engine,
            context,
            hub,
            self.desk,
            self._turns,
            self.set_status,
            reply or ReplyConfig(),
            metrics,
            commit_delay_s,
            submit_concurrency=submit_concurrency,
        )

    @property
    def block_size(self) -> int:
        """Tokens per engine KV block."""
        return self._engine.info.block_size

    @property
    def reply(self) -> ReplyConfig:
        return self._path.reply

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
            await self._path.submit(tenant, session_id, frame, reply_to)

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
