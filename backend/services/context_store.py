"""The context layer in the database: splitter rules, semantic blocks, topic history, invalidation events.

Short transactions, like ``sessions.py``: callers pass the DB session and commit. Rules for a tenant are the enabled
global rules (``tenant_id`` NULL) plus the tenant's own; a tenant rule with a global rule's name replaces it (that
is how a tenant switches a default off or changes its pattern). ``RuleSetCache`` compiles them once per tenant and
again only when they change; a stored rule that no longer compiles (a Python-only pattern from before RE2) is left
out of the chat's rule set, with one log line per compile, rather than stopping the tenant's chat.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, insert, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from backend.context.blocks import Block, BlockKey, BlockType
from backend.context.rules import Rule, RuleSet, compile_rule
from backend.context.splitter import DEFAULT_MIN_BLOCK_LENGTH
from backend.context.topic import TopicSettings, TopicUpdate
from backend.core.errors import SessionNotFoundError
from backend.core.offload import run_cpu
from backend.db.models import (
    ChatSession,
    InvalidationEvent,
    Message,
    SemanticBlock,
    SplitterRule,
    Tenant,
    TenantContextSettings,
    TopicHistory,
)
from backend.domain import HistoryPolicy, InvalidationReason

log = logging.getLogger("kvchat.context")


@dataclass(frozen=True, slots=True)
class ContextSettings:
    """A tenant's context settings, defaults filled in."""

    history_policy: HistoryPolicy = HistoryPolicy.EPOCH
    min_block_length: int = DEFAULT_MIN_BLOCK_LENGTH
    topic: TopicSettings = field(default_factory=TopicSettings)


async def load_rules(db: AsyncSession, tenant_id: str) -> list[Rule]:
    """The rules the tenant's splitter uses (enabled only), ordered by name; tenant rules override global ones."""
    rows = await db.execute(
        select(SplitterRule).where(or_(SplitterRule.tenant_id.is_(None), SplitterRule.tenant_id == tenant_id))
    )
    by_name: dict[str, SplitterRule] = {}
    for row in sorted(rows.scalars(), key=lambda r: r.tenant_id is not None):  # globals first, tenant rules win
        by_name[row.name] = row
    return [_rule(row) for name, row in sorted(by_name.items()) if row.enabled]


async def rules_version(db: AsyncSession, tenant_id: str) -> tuple[int, datetime | None]:
    """A cheap fingerprint of the tenant's rules: how many there are and when the latest was written."""
    row = await db.execute(
        select(func.count(), func.max(SplitterRule.updated_at)).where(
            or_(SplitterRule.tenant_id.is_(None), SplitterRule.tenant_id == tenant_id)
        )
    )
    count, latest = row.one()
    return int(count), latest


class RuleSetCache:
    """Compiled rule sets per tenant; ``get`` recompiles only when ``rules_version`` changed since the last compile."""

    def __init__(self) -> None:
        self._compiled: dict[str, tuple[tuple[int, datetime | None], RuleSet]] = {}

    async def get(
        self, db: AsyncSession, tenant_id: str, version: tuple[int, datetime | None] | None = None
    ) -> RuleSet:
        """The tenant's rule set at ``version`` (read here when not given: ``rules_version``)."""
        if version is None:
            version = await rules_version(db, tenant_id)
        cached = self._compiled.get(tenant_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        # NOTE: compiled in the tenant's turn on the CPU workers: up to a few hundred patterns, milliseconds each.
        rules, refused = await run_cpu(tenant_id, RuleSet.compile_usable, await load_rules(db, tenant_id))
        for exc in refused:
            log.warning("tenant %s: stored %s; the chat leaves it out until it is fixed", tenant_id, exc)
        self._compiled[tenant_id] = (version, rules)
        return rules


async def add_rule(db: AsyncSession, rule: Rule, tenant_id: str | None = None) -> int:
    """Store a rule after checking it compiles (``InvalidRuleError`` otherwise); returns its id."""
    compile_rule(rule)
    row = SplitterRule(
        tenant_id=tenant_id,
        name=rule.name,
        pattern=rule.pattern,
        block_type=rule.block_type.value,
        priority=rule.priority,
        language=rule.language,
        enabled=rule.enabled,
    )
    db.add(row)
    await db.flush()
    return row.id


async def session_and_tenant(
    db: AsyncSession, tenant_id: str, session_id: str
) -> tuple[ChatSession, Tenant, TenantContextSettings | None]:
    """The session (``SessionNotFoundError`` when it is not the tenant's), its tenant and the tenant's context
    settings row, in one query."""
    row = (
        await db.execute(
            select(ChatSession, Tenant, TenantContextSettings)
            .join(Tenant, Tenant.id == ChatSession.tenant_id)
            .outerjoin(TenantContextSettings, TenantContextSettings.tenant_id == Tenant.id)
            .where(ChatSession.id == session_id, ChatSession.tenant_id == tenant_id)
            .execution_options(populate_existing=True)
        )
    ).one_or_none()
    if row is None:
        raise SessionNotFoundError(f"session {session_id} not found")
    session, tenant, settings = row
    return session, tenant, settings


async def load_settings(db: AsyncSession, tenant_id: str) -> ContextSettings:
    return settings_of(await db.get(TenantContextSettings, tenant_id))


def settings_of(row: TenantContextSettings | None) -> ContextSettings:
    """A tenant's stored settings row (None: it never chose any) as settings, defaults filled in."""
    if row is None:
        return ContextSettings()
    topic = TopicSettings(
        shift_threshold=row.shift_threshold,
        start_temperature=row.start_temperature,
        shift_temperature=row.shift_temperature,
        backend=row.similarity_backend,
    )
    return ContextSettings(HistoryPolicy(row.history_policy), row.min_block_length, topic)


async def save_settings(db: AsyncSession, tenant_id: str, settings: ContextSettings) -> None:
    await db.merge(
        TenantContextSettings(
            tenant_id=tenant_id,
            history_policy=settings.history_policy.value,
            similarity_backend=settings.topic.backend,
            shift_threshold=settings.topic.shift_threshold,
            start_temperature=settings.topic.start_temperature,
            shift_temperature=settings.topic.shift_temperature,
            min_block_length=settings.min_block_length,
        )
    )
    await db.flush()


async def save_blocks(
    db: AsyncSession,
    session_id: str,
    message_id: int,
    blocks: Sequence[Block],
    known: Mapping[BlockKey, int] | None = None,
) -> list[int]:
    """Store one message's blocks in order, their parents resolved to row ids; returns the new ids.

    A parent is a ``BlockKey`` (message seq, index): earlier in this message, or in an earlier message of the session.
    ``known``: row ids the caller read already (the session's context); parents among them are not looked up again.
    """
    known, own = known or {}, {b.key for b in blocks}
    missing = {b.parent for b in blocks if b.parent is not None and b.parent not in known and b.parent not in own}
    earlier = {**known, **await _block_ids(db, session_id, missing)}
    if not blocks:
        return []
    # NOTE: one INSERT ... RETURNING for all of them, then one UPDATE for the parents inside this message (their ids
    # are known only now): two statements whatever the count, where a flush a block made one each, every one a trip
    # to the database with SQLite's one writer held (backend/db/sqlite_writer.py).
    rows = [
        {
            "session_id": session_id,
            "message_id": message_id,
            "block_index": block.index,
            "block_type": block.type.value,
            "char_start": block.start,
            "char_end": block.end,
            "token_count": block.token_count,
            "content_hash": block.content_hash,
            "topic_epoch": block.epoch,
            "parent_id": earlier.get(block.parent) if block.parent is not None else None,
        }
        for block in blocks
    ]
    returned = await db.execute(insert(SemanticBlock).returning(SemanticBlock.block_index, SemanticBlock.id), rows)
    by_index: dict[int, int] = {index: row_id for index, row_id in returned}
    ids = [by_index[block.index] for block in blocks]
    earlier.update({block.key: row_id for block, row_id in zip(blocks, ids, strict=True)})
    inner = [
        {"id": row_id, "parent_id": earlier[block.parent]}
        for block, row_id in zip(blocks, ids, strict=True)
        if block.parent is not None and block.parent in own
    ]
    if inner:
        await db.execute(update(SemanticBlock), inner)
    return ids


async def load_blocks(db: AsyncSession, session_id: str) -> list[Block]:
    """The session's blocks, oldest first, as splitter values (text cut from the stored messages)."""
    return [block for block, _ in await load_block_rows(db, session_id)]


async def load_block_rows(db: AsyncSession, session_id: str) -> list[tuple[Block, int]]:
    """The session's blocks, oldest first, each with its row id (one query)."""
    return blocks_of(await block_rows(db, session_id))


async def block_rows(db: AsyncSession, session_id: str) -> list[tuple[SemanticBlock, int, str]]:
    """The session's block rows in the prompt's order, each with its message's seq and text (one query)."""
    rows = await db.execute(
        select(SemanticBlock, Message.seq, Message.content)
        .join(Message, Message.id == SemanticBlock.message_id)
        .where(SemanticBlock.session_id == session_id)
        .order_by(Message.seq, SemanticBlock.block_index)
    )
    return [(row[0], row[1], row[2]) for row in rows]


def blocks_of(found: Sequence[tuple[SemanticBlock, int, str]]) -> list[tuple[Block, int]]:
    """Block rows (with their message's seq and text) as splitter values, each with its row id."""
    keys = {block.id: BlockKey(seq, block.block_index) for block, seq, _ in found}
    return [
        (
            Block(
                BlockKey(seq, b.block_index),
                BlockType(b.block_type),
                b.char_start,
                b.char_end,
                content[b.char_start : b.char_end],
                b.token_count,
                b.content_hash,
                b.topic_epoch,
                keys.get(b.parent_id) if b.parent_id is not None else None,
            ),
            b.id,
        )
        for b, seq, content in found
    ]


async def record_topic(
    db: AsyncSession, session_id: str, message_seq: int, topic: TopicUpdate, sections: Sequence[str] = ()
) -> None:
    """Append a row to the topic history (with the titles of the topic's handbook sections) and set the session's
    current temperature and epoch."""
    db.add(
        TopicHistory(
            session_id=session_id,
            message_seq=message_seq,
            similarity=topic.similarity,
            temperature=topic.temperature,
            shift=topic.shift,
            topic_epoch=topic.epoch,
            sections=json.dumps(list(sections), ensure_ascii=False),
        )
    )
    await db.execute(
        update(ChatSession)
        .where(ChatSession.id == session_id)
        .values(semantic_temperature=topic.temperature, topic_epoch=topic.epoch)
        .execution_options(synchronize_session=False)  # (no session object is held here: nothing to evaluate)
    )
    await db.flush()


async def topic_history(db: AsyncSession, session_id: str) -> list[TopicHistory]:
    rows = await db.execute(
        select(TopicHistory).where(TopicHistory.session_id == session_id).order_by(TopicHistory.message_seq)
    )
    return list(rows.scalars())


async def record_invalidation(
    db: AsyncSession,
    tenant_id: str,
    session_id: str | None,
    reason: InvalidationReason,
    actor: str,
    blocks_freed: int,
    tokens_freed: int,
) -> None:
    db.add(
        InvalidationEvent(
            tenant_id=tenant_id,
            session_id=session_id,
            reason=reason.value,
            actor=actor,
            blocks_freed=blocks_freed,
            tokens_freed=tokens_freed,
        )
    )
    await db.flush()


async def _block_ids(db: AsyncSession, session_id: str, keys: set[BlockKey]) -> dict[BlockKey, int]:
    if not keys:
        return {}
    rows = await db.execute(
        select(Message.seq, SemanticBlock.block_index, SemanticBlock.id)
        .join(Message, Message.id == SemanticBlock.message_id)
        .where(
            SemanticBlock.session_id == session_id,
            tuple_(Message.seq, SemanticBlock.block_index).in_([(k.seq, k.index) for k in keys]),
        )
    )
    return {BlockKey(seq, index): block_id for seq, index, block_id in rows}


def _rule(row: SplitterRule) -> Rule:
    return Rule(row.name, row.pattern, BlockType(row.block_type), row.priority, row.language, row.enabled)


def section_titles(row: TopicHistory) -> tuple[str, ...]:
    """The handbook sections a topic history row names (none for a row stored before the handbook existed)."""
    try:
        titles = json.loads(row.sections or "[]")
    except ValueError:
        return ()
    return tuple(str(t) for t in titles) if isinstance(titles, list) else ()
