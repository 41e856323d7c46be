"""The context layer of a chat turn: what the chat service asks of it, between the database and the engine.

- ``load``: what a turn reads of the session (``turn_read.py``: one round trip on Postgres), in the caller's
  transaction: the chat reads it in the one that stores the customer's message (``backend/chat/turn_path.py``), with
  the tenant's reply settings (``context_of`` then builds the context from those rows);
- ``plan`` (a worker thread, once per turn): observe the customer's message — split it into blocks (the tenant's
  rules, compiled once and again only when they change), move the session's topic (semantic temperature, epoch),
  choose the topic's handbook section(s) (``backend/context/sections.py``, replayed over the epoch's customer
  messages) — and ``prepare`` the turn's engine request, built by ``backend/context/builder.py`` under the tenant's
  history policy, and its token ids;
- ``record_customer``: store what ``plan`` observed (the blocks, a topic history row; the engine's temperature hint);
  ``observe_customer``: both, for a message no bot turn answers (a person holds the session);
- ``observe_reply``: split a stored reply into blocks of the epoch of the message it answers (and let the topic
  scorer embed it, off the path of the customer's next message);
- ``invalidate_dropped``: when the prompt drops an epoch the previous turn's prompt had, free the session's cached
  blocks from the first token that changed (``EngineClient.invalidate``) and store the event;
- ``pinned_context_edited``: after an admin edited the session's pinned context, free its cached blocks from the
  end of the tenant's system prompt and policy text on (which stay: every session shares them) and store the event;
- ``record_release``: store a closed session's cache release as an invalidation event.

Every engine call carries the session's cache namespace, derived on the server from the tenant
(``backend/core/namespaces.py``); ``load`` reads the tenant's system prompt, policy text and cache scope each turn, so
an admin's edit reaches the very next turn of every open session.

Each database step is one short session; splitting, similarity and tokenizing run in worker threads.

NOTE: no version of a session's context lives in this process: a turn's context is read under the session's lock,
with its message, so it is current by construction, whichever worker stored the session's earlier messages. What a
later read would add is written after the read, by this turn or another (``backend/chat/turn_path.py`` reads again
when its turn waited behind another of the session).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import Future

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.context.blocks import Block
from backend.context.builder import (
    SHARED_TYPES,
    ContextRequest,
    DropReason,
    build_context,
)
from backend.context.minilm import Array
from backend.context.sections import ChoiceSettings, SectionIndex, choose
from backend.context.splitter import Splitter
from backend.context.topic import TopicState, TopicTracker, identifier_keys
from backend.core.errors import TenantNotFoundError
from backend.core.namespaces import Namespaces
from backend.core.offload import run_cpu, spare_cpu
from backend.db.models import ChatSession, Message, Tenant
from backend.domain import InvalidationReason, MessageRole, MessageStatus
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import InvalidationResult, SegmentedPrompt, TokenizedPrompt, common_prefix
from backend.services import context_store, turn_read
from backend.services.context_history import epochs_of, history_message, in_order
from backend.services.context_store import RuleSetCache
from backend.services.handbook import HandbookCache
from backend.services.session_context import LastPrompt, Observation, Plan, PreparedPrompt, SessionContext
from backend.services.shared_scorer import shared_scorer
from backend.services.turn_read import TurnRows
from backend.tools.family import detect_family
from backend.tools.prompt import offer
from backend.tools.types import ToolFamily, ToolSpec

# The ``budget`` policy's prompt limit (the model's own budget still applies under every policy).
DEFAULT_POLICY_BUDGET_TOKENS = 1024
SYSTEM_ACTOR = "system"
log = logging.getLogger("kvchat.context")


class ContextService:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        engine: EngineClient,
        namespaces: Namespaces,
        policy_budget_tokens: int = DEFAULT_POLICY_BUDGET_TOKENS,
    ) -> None:
        self._sm = sessionmaker
        self._engine = engine
        self.namespaces = namespaces
        self._rules = RuleSetCache()
        self._handbooks = HandbookCache()
        self.choice = ChoiceSettings()
        self._policy_budget_tokens = policy_budget_tokens
        # NOTE: in memory, per process, and that is enough: it only finds what an epoch drop leaves cached. After a
        # restart, or when a session's previous turn ran on another worker, there is nothing (or something older) to
        # compare with and a drop goes unnoticed: its blocks age out of the cache like any unused block.
        self._last: dict[str, LastPrompt] = {}

    # ------------------------------------------------------------------ messages

    def plan(
        self,
        ctx: SessionContext,
        message: Message,
        budget: int,
        tools: Sequence[ToolSpec] = (),
        observe: bool = True,
    ) -> Plan:
        """Observe customer ``message`` (unless ``observe`` is off: a retried message was observed already) and
        prepare the prompt that answers it. Runs in a worker thread: the turn's one CPU step before the engine.

        NOTE: the context layer is bookkeeping around the turn: when observing fails, the customer still gets a reply
        (the message joins the history unsplit, in the epoch of the message before it)."""
        observation = None
        if observe:
            try:
                observation = self._observe_customer(ctx, message)
            except Exception:
                log.exception("the context layer failed on message %s/%d", ctx.session_id, message.seq)
        if observation is not None:
            update = observation.update
            ctx = ctx.observed(message.seq, update, observation.blocks, None, observation.sections)
        return Plan(observation, ctx, self.prepare(ctx, message.seq, budget, tools))

    def prefetch(self, tenant_id: str, text: str) -> Future[Array | None] | None:
        """Start encoding a customer message for the tenant's section choice while the message is stored (step 2 of
        ``chat/turn_path.py``): the turn's plan then finds its vector in the encoder's cache, so the MiniLM encode
        (~9 ms of a core) runs beside the database's round trips, not after them. Nothing before the tenant's first
        turn has built its handbook index (None then). Only while the tenant has no other CPU work: under load the
        encode would queue ahead of the plans of turns already stored (the plan encodes it anyway)."""
        index = self._handbooks.current(tenant_id)
        if index is None or self.choice.bm25_weight >= 1.0:  # (BM25 alone: ``choose`` encodes nothing)
            return None
        return spare_cpu(tenant_id, index.embed, [text])

    async def record_customer(self, ctx: SessionContext, message: Message, observation: Observation) -> SessionContext:
        """Store what ``plan`` observed of ``message`` (its blocks, a topic history row, the session's topic;
        committed) and hint the engine; ``ctx`` is the plan's context. Returns it with the blocks' row ids."""
        update, blocks = observation.update, observation.blocks
        async with self._sm() as db:
            ids = await context_store.save_blocks(db, ctx.session_id, message.id, blocks, ctx.block_ids)
            await context_store.record_topic(db, ctx.session_id, message.seq, update, observation.sections)
            await db.commit()
        # NOTE: an eviction hint: when memory runs short, the engine lets a cold topic's blocks go first.
        self._engine.set_session_temperature(ctx.session_id, update.temperature)
        return dataclasses.replace(
            ctx, block_ids={**ctx.block_ids, **{b.key: i for b, i in zip(blocks, ids, strict=True)}}
        )

    async def observe_customer(self, ctx: SessionContext, message: Message) -> Observation:
        """Observe and store a customer message no bot turn answers (``ctx``: read with it); returns the topic."""
        observation = await run_cpu(ctx.tenant_id, self._observe_customer, ctx, message)
        await self.record_customer(ctx, message, observation)
        return observation

    async def observe_reply(self, ctx: SessionContext, message: Message, epoch: int) -> None:
        """Store a reply's blocks (once: a replayed reply already has them); ``ctx`` is the context its prompt was
        built from (the splitter's rules and the earlier blocks it may refer back to)."""
        if not message.content or any(b.key.seq == message.seq for b in ctx.blocks):
            return
        tenant_id, session_id = ctx.tenant_id, ctx.session_id
        blocks = await run_cpu(tenant_id, self._observe_reply, ctx, message, epoch)
        async with self._sm() as db:
            await context_store.save_blocks(db, session_id, message.id, blocks, ctx.block_ids)
            await db.commit()

    def _observe_reply(self, ctx: SessionContext, message: Message, epoch: int) -> list[Block]:
        # NOTE: the topic scorer embeds the reply now, so the customer's next message, which waits on the scorer,
        # finds it cached (static vectors: ~0.1 ms; the full MiniLM encoder: tens of ms, here rather than there).
        shared_scorer(ctx.settings.topic.backend).prepare(message.content)
        return self._splitter(ctx).split(message.content, seq=message.seq, epoch=epoch, history=ctx.blocks)

    def _observe_customer(self, ctx: SessionContext, message: Message) -> Observation:
        update = self._tracker(ctx, message.seq).observe_customer(message.content)
        blocks = self._splitter(ctx).split(message.content, seq=message.seq, epoch=update.epoch, history=ctx.blocks)
        return Observation(update, tuple(blocks), self._sections(ctx, message, update.epoch))

    def _sections(self, ctx: SessionContext, message: Message, epoch: int) -> tuple[str, ...]:
        """The handbook sections for the epoch of ``message``: chosen over the epoch's customer messages in order."""
        if not ctx.handbook.sections:
            return ()
        texts = [
            m.content
            for m in _before(ctx.messages, message.seq)
            if m.role == MessageRole.USER.value and ctx.epochs.get(m.seq) == epoch
        ]
        chosen = choose(ctx.handbook, [*texts, message.content], self.choice)
        return tuple(ctx.handbook.sections[i].title for i in chosen)

    def _tracker(self, ctx: SessionContext, seq: int) -> TopicTracker:
        """The session's topic tracker as its stored state left it (before message ``seq``): the current epoch's
        messages replayed into its memory, so the scorer reads the epoch as it would have live."""
        topic = ctx.settings.topic
        identify = identifier_keys(ctx.rules)
        state = TopicState(ctx.epoch, ctx.temperature)
        for m in _before(ctx.messages, seq):
            if not m.content or ctx.epochs[m.seq] != ctx.epoch:
                continue
            if m.role == MessageRole.USER.value:
                state.remember_customer(m.content, identify(m.content), topic.window)
            else:
                state.remember_agent(m.content, identify(m.content), topic.window)
        return TopicTracker(topic, shared_scorer(topic.backend), identify, state)

    def _splitter(self, ctx: SessionContext) -> Splitter:
        return Splitter(ctx.rules, self._count_tokens, ctx.settings.min_block_length)

    def _count_tokens(self, text: str) -> int:
        return len(self._engine.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------ the turn's prompt

    async def load(self, db: AsyncSession, tenant_id: str, session_id: str) -> SessionContext:
        """Everything a turn needs from the database (read only, so safe to retry): the session with its tenant and
        the tenant's settings, its messages, topic history and blocks, and the rules' version (``turn_read``: one
        round trip on Postgres)."""
        return await self.context_of(db, await turn_read.read(db, tenant_id, session_id, with_reply=False))

    async def context_of(self, db: AsyncSession, rows: TurnRows) -> SessionContext:
        """The session's context from its rows (``turn_read``); the database is read again only for what changed
        since this process last read it: the handbook's sections at a new version, the rules at a new version."""
        session, tenant = rows.session, rows.tenant
        found = context_store.blocks_of(rows.blocks)
        history = rows.history
        return SessionContext(
            tenant.id,
            session.id,
            self.namespaces.of(tenant.id, tenant.cache_scope),
            tenant.system_prompt,
            tenant.policy_text,
            session.topic_epoch,
            session.semantic_temperature,
            session.pinned_context,
            rows.messages,
            epochs_of(rows.messages, {row.message_seq: row.topic_epoch for row in history}),
            {row.message_seq: row.temperature for row in history},
            [block for block, _ in found],
            {block.key: block_id for block, block_id in found},
            context_store.settings_of(rows.context_settings),
            await self._rules.get(db, tenant.id, rows.rules_version),
            await self._handbooks.get(db, tenant.id, tenant.handbook_version),
            {row.message_seq: context_store.section_titles(row) for row in history},
        )

    @property
    def tool_family(self) -> ToolFamily:
        """How the model writes tool calls (read from its chat template)."""
        template = getattr(self._engine.tokenizer.hf, "chat_template", None)
        return detect_family(template if isinstance(template, str) else None)

    def prepare(
        self, ctx: SessionContext, user_seq: int, budget: int, tools: Sequence[ToolSpec] = ()
    ) -> PreparedPrompt:
        """The prompt answering message ``user_seq`` with ``tools`` offered, and its token ids. Runs in a worker
        thread (it tokenizes). Earlier replies that called tools come after their calls and results."""
        family = self.tool_family
        by_seq: dict[int, list[Block]] = {}
        for block in ctx.blocks:
            by_seq.setdefault(block.key.seq, []).append(block)
        history = tuple(
            history_message(m, ctx.epochs[m.seq], tuple(by_seq.get(m.seq, ())), family)
            for m in in_order(ctx.messages)
            if (m.role == MessageRole.USER.value and m.seq <= user_seq)
            or (
                m.role == MessageRole.ASSISTANT.value
                and m.status == MessageStatus.COMPLETE.value
                and (m.reply_to_seq or 0) < user_seq
            )
            or (m.role == MessageRole.AGENT.value and m.seq < user_seq)  # a person's turns: ordinary history
        )
        epoch = ctx.epochs.get(user_seq, ctx.epoch)
        by_title = {s.title: s for s in ctx.handbook.sections}
        sections = tuple(t for t in ctx.sections_at(user_seq) if t in by_title)
        request = ContextRequest(
            ctx.system_prompt,
            history,
            epoch,
            ctx.settings.history_policy,
            budget,
            pinned_context=ctx.pinned_context,
            policy_text=ctx.policy_text,
            sections=tuple(by_title[t].rendered() for t in sections),
            policy_budget_tokens=self._policy_budget_tokens,
            block_ids=ctx.block_ids,
            identify=identifier_keys(ctx.rules),
        )
        counted: list[tuple[SegmentedPrompt, SegmentedPrompt, TokenizedPrompt]] = []

        def count(prompt: SegmentedPrompt) -> int:
            sent = offer(prompt, tools, family)
            counted[:] = [(prompt, sent, self._engine.tokenize_prompt(sent))]
            return len(counted[0][2].token_ids)

        built = build_context(request, count)
        if counted[0][0] is not built.prompt:
            count(built.prompt)
        _, sent, tokenized = counted[0]
        context_from = max((s.end for s in tokenized.spans if s.block_type in SHARED_TYPES), default=0)
        temperature = ctx.temperatures.get(user_seq, ctx.temperature)
        return PreparedPrompt(built, tokenized, sent, context_from, ctx.namespace, epoch, temperature, sections)

    # ------------------------------------------------------------------ invalidation

    async def invalidate_dropped(
        self, tenant_id: str, session_id: str, prepared: PreparedPrompt
    ) -> InvalidationResult | None:
        """Free what the session's previous prompt had and this one dropped with an earlier epoch; store the event.

        ``from_position`` is the first token where the two prompts differ: everything before it is still this
        prompt's prefix (the tenant's system prompt above all), so it stays cached.
        """
        position = self.dropped_from(session_id, prepared)
        if position is None:
            return None
        reason = InvalidationReason.EPOCH_DROPPED
        return await self.invalidate(tenant_id, session_id, position, reason, SYSTEM_ACTOR, prepared.namespace)

    def dropped_from(self, session_id: str, prepared: PreparedPrompt) -> int | None:
        """Remember ``prepared`` as the session's latest prompt; the first token where it leaves the previous one when
        it dropped an epoch the previous one had (what ``invalidate_dropped`` frees from), else None."""
        built = prepared.built
        previous = self._last.get(session_id)
        self._last[session_id] = LastPrompt(prepared.token_ids, frozenset(built.kept), prepared.context_from)
        if previous is None:
            return None
        epoch_dropped = {d.seq for d in built.dropped if d.reason is DropReason.EPOCH}
        if not previous.kept & epoch_dropped:
            return None
        return common_prefix(previous.token_ids, prepared.token_ids)

    async def pinned_context_edited(self, tenant_id: str, session_id: str, actor: str) -> InvalidationResult:
        """Free the session's cached blocks that depend on its pinned context; store the event.

        NOTE: from the first token after the tenant's system prompt and policy text, where the pinned context starts
        (or, when it was empty, is inserted): part 1's blocks stay, shared by every session. Without a prompt of this
        session in memory (a restart), the session's whole chain goes, save what other sessions share.
        """
        last = self._last.get(session_id)
        position = last.context_from if last is not None else 0
        return await self.invalidate(tenant_id, session_id, position, InvalidationReason.PINNED_CONTEXT_EDITED, actor)

    async def invalidate(
        self,
        tenant_id: str,
        session_id: str,
        from_position: int,
        reason: InvalidationReason,
        actor: str,
        namespace: str | None = None,
    ) -> InvalidationResult:
        """Free the session's cached blocks from token ``from_position`` on (and their dependents); store the event.
        ``namespace``: the tenant's, when the caller just read it (else it is read here)."""
        async with self._sm() as db:
            namespace = namespace or await self.namespace_of(db, tenant_id)
            result = await control.invalidate(
                self._engine, namespace, session=session_id, from_position=from_position, reason=reason.value
            )
            await context_store.record_invalidation(
                db, tenant_id, session_id, reason, actor, result.blocks_freed, result.tokens_freed
            )
            await db.commit()
        return result

    async def record_release(
        self, session_id: str, blocks_freed: int, reason: InvalidationReason, actor: str = SYSTEM_ACTOR
    ) -> None:
        """Store the release of a session's cache (``EngineClient.release_session`` frees whole blocks only)."""
        self.forget(session_id)
        async with self._sm() as db:
            session = await db.get(ChatSession, session_id)
            if session is None:
                return  # deleted with its events' session link: nothing to attach the event to
            tokens = blocks_freed * self._engine.info.block_size
            await context_store.record_invalidation(
                db, session.tenant_id, session_id, reason, actor, blocks_freed, tokens
            )
            await db.commit()

    async def namespace_of(self, db: AsyncSession, tenant_id: str) -> str:
        """The tenant's cache namespace as its stored ``cache_scope`` says now."""
        return self.namespaces.of(tenant_id, (await _tenant(db, tenant_id)).cache_scope)

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)

    def last_prompt(self, session_id: str) -> LastPrompt | None:
        return self._last.get(session_id)

    def handbook_index(self, tenant_id: str) -> SectionIndex | None:
        """The tenant's handbook index as this process last built it (None before its first turn)."""
        return self._handbooks.current(tenant_id)


def _before(messages: Sequence[Message], seq: int) -> list[Message]:
    """The messages before message ``seq`` in conversation order (a turn that waited behind another of its session
    reads the messages stored after its own too)."""
    ordered = in_order(messages)
    mine = next((n for n, m in enumerate(ordered) if m.seq == seq), len(ordered))
    return ordered[:mine]


async def _tenant(db: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await db.get(Tenant, tenant_id, populate_existing=True)
    if tenant is None:
        raise TenantNotFoundError(f"no tenant {tenant_id}")
    return tenant
