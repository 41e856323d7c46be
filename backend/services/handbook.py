"""A tenant's handbook: stored sections, their edits (versioned, with the cache following exactly), and the
per-process index each turn ranks them with.

- ``replace``: load a whole handbook (Markdown or ABCD-style JSON); sections whose title and text are unchanged keep
  their row and their cached blocks; a changed or removed section's old text leaves the cache (``forget_text``);
- ``edit_section``: replace one section's text;
- ``HandbookCache``: the ``SectionIndex`` of a tenant's current version, built once per version and process (the
  version is read with the tenant each turn, so every worker sees an edit at its next turn).

NOTE: a section's cached blocks are found by the token ids of ``[system][policy][section]`` (and of each
``[system][policy][other][section]``: a topic may hold two sections), rendered as the builder renders them; the
engine frees that chain from the section's first token on, with every block after it in any session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.context.builder import HANDBOOK_SECTION, prefix_segments, section_segments
from backend.context.errors import HandbookError
from backend.context.grounding import Grounding
from backend.context.handbook import HandbookFormat, HandbookLimits, Section, check, parse
from backend.context.sections import SectionIndex
from backend.core.errors import TenantNotFoundError
from backend.core.namespaces import Namespaces
from backend.core.offload import run_cpu
from backend.db.models import HandbookSection, Tenant
from backend.domain import InvalidationReason, MessageRole
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import InvalidationResult, SegmentedPrompt, common_prefix
from backend.services import context_store
from backend.services.cache_admin import namespace_of
from backend.services.shared_scorer import section_embedder

ADMIN_ACTOR = "admin"


@dataclass(frozen=True, slots=True)
class HandbookEdit:
    """What an edit did: the new version, the sections kept, changed, added and removed, and the blocks freed."""

    version: int
    sections: int
    kept: int
    changed: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    freed: InvalidationResult

    def describe(self) -> str:
        """For the audit row: ``handbook v3: 1 changed, 0 added, 0 removed; freed 12 blocks (192 tokens)``."""
        return (
            f"handbook v{self.version}: {len(self.changed)} changed, {len(self.added)} added, {len(self.removed)} "
            f"removed, {self.kept} kept; freed {self.freed.blocks_freed} blocks ({self.freed.tokens_freed} tokens)"
        )


async def sections_of(db: AsyncSession, tenant_id: str) -> list[HandbookSection]:
    rows = await db.execute(
        select(HandbookSection).where(HandbookSection.tenant_id == tenant_id).order_by(HandbookSection.position)
    )
    return list(rows.scalars())


async def replace(
    db: AsyncSession,
    engine: EngineClient,
    namespaces: Namespaces,
    tenant_id: str,
    content: str,
    fmt: HandbookFormat,
    limits: HandbookLimits,
    actor: str = ADMIN_ACTOR,
) -> HandbookEdit:
    """Replace the tenant's handbook with the sections of ``content`` (``HandbookError`` when it does not parse or
    passes a limit: nothing is stored then)."""
    sections = await run_cpu(tenant_id, parse, content, fmt)
    check(sections, limits)
    return await _store(db, engine, namespaces, tenant_id, sections, actor)


async def edit_section(
    db: AsyncSession,
    engine: EngineClient,
    namespaces: Namespaces,
    tenant_id: str,
    title: str,
    text: str,
    limits: HandbookLimits,
    actor: str = ADMIN_ACTOR,
) -> HandbookEdit:
    """Replace the text of the section titled ``title`` (``HandbookError`` when there is none)."""
    old = await sections_of(db, tenant_id)
    if not any(row.title == title for row in old):
        raise HandbookError(f"the handbook has no section titled {title!r}")
    sections = [dataclasses.replace(section_of(r), text=text) if r.title == title else section_of(r) for r in old]
    check(sections, limits)
    return await _store(db, engine, namespaces, tenant_id, sections, actor)


async def clear(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant_id: str, actor: str = ADMIN_ACTOR
) -> HandbookEdit:
    """Remove every section (prompts hold none from the next turn on)."""
    return await _store(db, engine, namespaces, tenant_id, [], actor)


async def _store(
    db: AsyncSession,
    engine: EngineClient,
    namespaces: Namespaces,
    tenant_id: str,
    sections: Sequence[Section],
    actor: str,
) -> HandbookEdit:
    tenant = await db.get(Tenant, tenant_id, populate_existing=True)
    if tenant is None:
        raise TenantNotFoundError(f"no tenant {tenant_id}")
    old = await sections_of(db, tenant_id)
    old_by_title = {r.title: r for r in old}
    new_titles = {s.title for s in sections}
    version = tenant.handbook_version + 1
    stale = [Section(r.title, r.text) for r in old if r.title not in new_titles]
    changed, added, kept = [], [], 0
    await db.execute(delete(HandbookSection).where(HandbookSection.tenant_id == tenant_id))
    for position, s in enumerate(sections):
        row = old_by_title.get(s.title)
        if row is None:
            added.append(s.title)
        elif row.content_hash != s.content_hash:
            changed.append(s.title)
            stale.append(Section(row.title, row.text))
        else:
            kept += 1
        db.add(
            HandbookSection(
                tenant_id=tenant_id,
                position=position,
                title=s.title,
                text=s.text,
                content_hash=s.content_hash,
                examples=json.dumps(list(s.examples), ensure_ascii=False),
                version=row.version if row is not None and row.content_hash == s.content_hash else version,
            )
        )
    tenant.handbook_version = version
    await db.flush()
    old_sections = [Section(r.title, r.text) for r in old]
    freed = await forget_text(engine, namespace_of(namespaces, tenant), tenant, old_sections, stale)
    if freed.blocks_freed or freed.deferred:
        await context_store.record_invalidation(
            db, tenant_id, None, InvalidationReason.HANDBOOK_EDITED, actor, freed.blocks_freed, freed.tokens_freed
        )
    await db.commit()
    removed = tuple(r.title for r in old if r.title not in new_titles)
    return HandbookEdit(version, len(sections), kept, tuple(changed), tuple(added), removed, freed)


async def forget_text(
    engine: EngineClient, namespace: str, tenant: Tenant, old: Sequence[Section], stale: Sequence[Section]
) -> InvalidationResult:
    """Free the cached blocks that hold a ``stale`` section's text, alone or after another section of ``old``."""
    total = InvalidationResult(0, 0, 0)
    for section in stale:
        for before in [None, *(s for s in old if s.title != section.title)]:
            chain = [before, section] if before is not None else [section]
            ids, start = await asyncio.to_thread(_section_ids, engine, tenant.system_prompt, tenant.policy_text, chain)
            if start is None:
                continue
            freed = await control.invalidate_prefix(
                engine, namespace, ids, start, InvalidationReason.HANDBOOK_EDITED.value
            )
            total = InvalidationResult(
                total.blocks_freed + freed.blocks_freed,
                total.tokens_freed + freed.tokens_freed,
                total.deferred + freed.deferred,
            )
    return total


def _section_ids(
    engine: EngineClient, system_prompt: str, policy_text: str, chain: Sequence[Section | None]
) -> tuple[list[int], int | None]:
    """The token ids of ``[system][policy][chain...]`` as every prompt renders them, and the first token of the last
    section's own text (None when it renders to nothing).

    NOTE: not the start of its segment: the separator and the ``Handbook:`` label open every section, so the block
    holding them (and the system prompt's tail) is the same for every section and holds none of this one's text.
    """
    ids, end = _render_ids(engine, system_prompt, policy_text, chain)
    if end is None:
        return [], None
    other, _ = _render_ids(engine, system_prompt, policy_text, [*chain[:-1], Section("\u2063", "\u2063")])
    return ids[:end], common_prefix(ids, other)


def _render_ids(
    engine: EngineClient, system_prompt: str, policy_text: str, chain: Sequence[Section | None]
) -> tuple[list[int], int | None]:
    head = prefix_segments(system_prompt, policy_text)
    segments = head + section_segments(bool(head), [s.rendered() for s in chain if s is not None])
    prompt = SegmentedPrompt.of((MessageRole.SYSTEM.value, segments), add_generation_prompt=False)
    tokenized = engine.tokenize_prompt(prompt)
    spans = [s for s in tokenized.spans if s.block_type == HANDBOOK_SECTION]
    return tokenized.token_ids, (spans[-1].end if spans else None)


def section_of(row: HandbookSection) -> Section:
    """A stored section as the context layer reads it."""
    try:
        examples = json.loads(row.examples or "[]")
    except ValueError:
        examples = []
    return Section(row.title, row.text, tuple(str(e) for e in examples) if isinstance(examples, list) else ())


def parse_format(name: str) -> HandbookFormat:
    """``markdown`` or ``abcd`` (``HandbookError`` otherwise)."""
    try:
        return HandbookFormat(name)
    except ValueError:
        raise HandbookError(f"unknown handbook format {name!r}: use 'markdown' or 'abcd'") from None


def sections_json(titles: Sequence[str]) -> str:
    return json.dumps(list(titles), ensure_ascii=False)


class HandbookCache:
    """Per process: each tenant's ``SectionIndex`` for its current handbook version (rebuilt when it moves)."""

    def __init__(self) -> None:
        self._indexes: dict[str, tuple[int, SectionIndex]] = {}
        self._lock = threading.Lock()

    async def get(self, db: AsyncSession, tenant_id: str, version: int) -> SectionIndex:
        with self._lock:
            cached = self._indexes.get(tenant_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        rows = await sections_of(db, tenant_id)
        sections = [section_of(r) for r in rows]
        index = await run_cpu(tenant_id, SectionIndex, sections, section_embedder())
        with self._lock:
            self._indexes[tenant_id] = (version, index)
        return index

    def current(self, tenant_id: str) -> SectionIndex | None:
        """The index last built for the tenant, whatever its version."""
        with self._lock:
            cached = self._indexes.get(tenant_id)
        return cached[1] if cached is not None else None


async def v1_grounding(sessionmaker: async_sessionmaker[AsyncSession], tenant: Tenant) -> Grounding:
    """What a ``/v1`` reply of the tenant may take contact details from (its guard on): the system prompt, the policy
    text and the handbook (the request's own messages are added by the service)."""
    async with sessionmaker() as db:
        rows = await sections_of(db, tenant.id)
    return Grounding((tenant.system_prompt, tenant.policy_text, *(r.text for r in rows)))
