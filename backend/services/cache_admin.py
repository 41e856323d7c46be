"""What a tenant's admin does to the engine's prefix cache: flush one session's blocks or the whole tenant's, erase a
deleted session's blocks from every tier, choose the tenant's cache scope and pin its prefix; and what follows when
the tenant's system prompt or policy text changes.

Every engine call carries the tenant's cache namespace (``backend/core/namespaces.py``), derived on the server, so
a tenant's flush, erasure or pin never reaches another tenant's blocks. Each flush and erasure is stored as an
``invalidation_events`` row.

Decisions:

- **Editing the system prompt or the policy text flushes the tenant's namespace.** They are part 1 of every prompt, so
  every cached block of every session of the tenant depends on them (the cache is causal): the whole namespace is
  exactly the dependent set, and ``flush_namespace`` frees it (in every tier) at once instead of session by session.
  Blocks a reply in flight holds go when it ends. Chained hashes alone would already keep the old blocks from ever
  matching; the flush gives their memory and disk back now.
- **A tenant on the public namespace shares it**, so neither its prompt edit nor its whole-tenant flush touches the
  namespace (that would flush every opted-in tenant): an edit leaves the old blocks to age out, a whole-tenant flush
  is refused (``NamespaceSharedError``; flush sessions one by one). Pinning needs the private scope for the same
  reason (``unpin`` is per namespace).
- **Pinning** pins the token ids of part 1 as the builder renders it (``prefix_token_ids``), again after every edit
  of part 1, and at every start for the tenants that have ``pin_prefix`` on.
- **Replicas that cannot do it are named.** With engine replicas, a flush, an erasure or a pin reports each replica
  where nothing was done (a vLLM one, or one that failed: ``backend/engine_client/replica_report.py``); the routes
  answer 207 and the audit row names them. A vLLM replica has one coarser erase, the reset of its whole prefix
  cache: the tenant's ``replica_erase`` chooses it (every session on that replica loses its cached prefixes) or the
  report (docs/scale-out.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.context.builder import PREFIX_TYPES, prefix_prompt
from backend.core.errors import InvalidCacheSettingsError, NamespaceSharedError, PinRefusedError, TenantNotFoundError
from backend.core.namespaces import CacheScope, Namespaces
from backend.db.models import Tenant
from backend.domain import InvalidationReason, ReplicaErase
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.replica_report import PrefixCacheReset, ReplicaOutcome, ReportedErasure, report_of
from backend.engine_client.values import ErasureResult, InvalidationResult, InvalidRequestError, PinResult
from backend.services import context_store
from backend.services import sessions as store

log = logging.getLogger("kvchat.cache")
ADMIN_ACTOR = "admin"


@dataclass(frozen=True, slots=True)
class TenantCacheChange:
    cache_scope: CacheScope
    pin_prefix: bool
    replica_erase: ReplicaErase = ReplicaErase.REPORT


@dataclass(frozen=True, slots=True)
class TenantCache:
    """The tenant's cache settings as stored now, and what a change pinned (None: nothing pinned by it)."""

    cache_scope: CacheScope
    pin_prefix: bool
    pinned: PinResult | None
    replica_erase: ReplicaErase = ReplicaErase.REPORT


@dataclass(frozen=True, slots=True)
class PrefixEdit:
    """What an edit of part 1 did to the cache: blocks freed (None: a shared namespace, left alone), pinned anew."""

    tenant: Tenant
    freed: InvalidationResult | None
    pinned: PinResult | None

    def describe(self) -> str:
        """For the edit's audit row; with engine replicas, also those where nothing was flushed or pinned."""
        if self.freed is None:
            parts = ["namespace shared: nothing flushed"]
        else:
            parts = [f"freed {self.freed.blocks_freed} blocks", report_of(self.freed).describe("flushed")]
        if self.pinned is not None:
            parts += [f"pinned {self.pinned.blocks} blocks", report_of(self.pinned).describe("pinned")]
        return "; ".join(p for p in parts if p)


def namespace_of(namespaces: Namespaces, tenant: Tenant) -> str:
    return namespaces.of(tenant.id, tenant.cache_scope)


# ---------------------------------------------------------------------- flushes and erasure


async def flush_session(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant: Tenant, session_id: str
) -> InvalidationResult:
    """Free the session's cached blocks (its whole chain; what other sessions use stays). The session stays open.

    NOTE: from position 0: the chain's first blocks are the tenant's part 1, kept anyway while another session
    lists them (``EngineClient.invalidate`` protects other sessions' chains and running requests).
    """
    await store.get_session(db, tenant.id, session_id)
    reason = InvalidationReason.ADMIN_FLUSH
    namespace = namespace_of(namespaces, tenant)
    result = await control.invalidate(engine, namespace, session=session_id, from_position=0, reason=reason.value)
    await _record(db, tenant.id, session_id, reason, result.blocks_freed, result.tokens_freed)
    return result


async def flush_tenant(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant: Tenant
) -> InvalidationResult:
    """Free every cached block of the tenant's namespace (blocks in flight go when their request ends)."""
    if CacheScope(tenant.cache_scope) is CacheScope.PUBLIC:
        raise NamespaceSharedError(
            "the tenant uses the shared public cache namespace: flush its sessions one by one, or set cache_scope to "
            "private first"
        )
    reason = InvalidationReason.ADMIN_FLUSH
    result = await control.flush_namespace(engine, namespace_of(namespaces, tenant), reason.value)
    await _record(db, tenant.id, None, reason, result.blocks_freed, result.tokens_freed)
    return result


def describe_flush(result: InvalidationResult, scope: str) -> str:
    """What a flush freed, for its audit row: ``freed 3 blocks (48 tokens) of the session``, then the replicas where
    nothing was flushed (``; not flushed on http://r2 (unsupported: ...)``)."""
    freed = f"freed {result.blocks_freed} blocks ({result.tokens_freed} tokens) of {scope}"
    gaps = report_of(result).describe("flushed")
    return f"{freed}; {gaps}" if gaps else freed


async def erase_coarsely(engine: EngineClient, choice: ReplicaErase, erased: ErasureResult) -> ErasureResult:
    """Where the tenant chose ``reset_cache``, reset the whole prefix cache of each replica that has no per-session
    erase (``erased`` names them); the result reports what each reset did. Otherwise ``erased`` as it is."""
    report = report_of(erased)
    unsupported = report.with_outcome(ReplicaOutcome.UNSUPPORTED)
    if choice is not ReplicaErase.RESET_CACHE or not unsupported or not isinstance(engine, PrefixCacheReset):
        return erased
    reset = await control.threaded(engine, engine.reset_prefix_caches, unsupported)
    for result in reset.results:
        log.warning("erasure: the whole prefix cache of %s: %s", result.replica, result.outcome.value)
    return ReportedErasure(erased.memory_blocks, erased.disk_blocks, report.replaced(reset))


def describe_erasure(erased: ErasureResult) -> str:
    """What an erasure removed, for its audit row: the blocks by tier, the replicas whose whole prefix cache was reset,
    and the replicas where nothing was erased."""
    report = report_of(erased)
    parts = [f"erased {erased.memory_blocks} memory and {erased.disk_blocks} disk blocks"]
    if reset := report.with_outcome(ReplicaOutcome.CACHE_RESET):
        parts.append("reset the whole prefix cache of " + ", ".join(reset))
    if not report.complete:
        parts.append(report.describe("erased"))
    return "; ".join(parts)


async def record_erasure(db: AsyncSession, tenant_id: str, erasure: ErasureResult, block_size: int) -> None:
    """Store the erasure as an invalidation event (with no session: its row is gone)."""
    blocks = erasure.memory_blocks + erasure.disk_blocks
    await _record(db, tenant_id, None, InvalidationReason.SESSION_ERASED, blocks, blocks * block_size)


# ---------------------------------------------------------------------- part 1: edits and pinning


def prefix_token_ids(engine: EngineClient, system_prompt: str, policy_text: str) -> list[int]:
    """The token ids of part 1 (system prompt + policy text) that start every prompt of the tenant.

    NOTE: rendered as a system message without a generation prompt, then cut where part 1's segments end: the
    template's closing tokens that follow are not in a prompt whose system message goes on with pinned context.
    """
    prompt = prefix_prompt(system_prompt, policy_text)
    if prompt is None:
        return []
    tokenized = engine.tokenize_prompt(prompt)
    end = max((s.end for s in tokenized.spans if s.block_type in PREFIX_TYPES), default=0)
    return tokenized.token_ids[:end]


async def pin(engine: EngineClient, namespaces: Namespaces, tenant: Tenant) -> PinResult:
    """(Re)pin the tenant's part 1 in its namespace, in place of its earlier pin (kept when this one is refused:
    ``PinRefusedError``, over the operator's pinned share)."""
    namespace = namespace_of(namespaces, tenant)
    try:
        token_ids = prefix_token_ids(engine, tenant.system_prompt, tenant.policy_text)
        result = await control.pin_prefix(engine, namespace, token_ids)
    except InvalidRequestError as exc:
        raise PinRefusedError(f"the prefix cannot be pinned: {exc}") from exc
    return result


async def prefix_edited(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant: Tenant, actor: str = ADMIN_ACTOR
) -> PrefixEdit:
    """After the tenant's system prompt or policy text changed (committed): flush what depended on the old one and
    pin the new one when the tenant pins. A refused pin does not undo the edit: it is logged and reported."""
    freed: InvalidationResult | None = None
    if CacheScope(tenant.cache_scope) is CacheScope.PRIVATE:
        reason = InvalidationReason.TENANT_PROMPT_EDITED
        freed = await control.flush_namespace(engine, namespace_of(namespaces, tenant), reason.value)
        await context_store.record_invalidation(
            db, tenant.id, None, reason, actor, freed.blocks_freed, freed.tokens_freed
        )
        await db.commit()
    pinned = await _pin_or_log(engine, namespaces, tenant) if tenant.pin_prefix else None
    return PrefixEdit(tenant, freed, pinned)


async def set_tenant_cache(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant_id: str, change: TenantCacheChange
) -> TenantCache:
    """Store the tenant's cache scope and pin setting; pin or unpin to match. Nothing is stored when the pin fails.

    A scope change moves the tenant's next requests to the other namespace; its blocks in the old one are no longer
    reachable and age out like unused blocks (a private namespace's can be flushed before switching).
    """
    if change.pin_prefix and change.cache_scope is CacheScope.PUBLIC:
        raise InvalidCacheSettingsError("pin_prefix needs cache_scope private: the public namespace is shared")
    tenant = await _tenant(db, tenant_id)
    old_namespace, was_pinned = namespace_of(namespaces, tenant), tenant.pin_prefix
    tenant.cache_scope = change.cache_scope.value
    # NOTE: a refused pin raises before anything is stored, and the engine kept the earlier pin
    pinned = await pin(engine, namespaces, tenant) if change.pin_prefix else None
    if was_pinned and not change.pin_prefix:
        await control.unpin(engine, old_namespace)
    tenant.pin_prefix = change.pin_prefix
    tenant.replica_erase = change.replica_erase.value
    await db.commit()
    return TenantCache(change.cache_scope, change.pin_prefix, pinned, change.replica_erase)


async def tenant_cache(db: AsyncSession, tenant_id: str) -> TenantCache:
    tenant = await _tenant(db, tenant_id)
    return TenantCache(CacheScope(tenant.cache_scope), tenant.pin_prefix, None, ReplicaErase(tenant.replica_erase))


async def pin_at_start(
    sessionmaker: async_sessionmaker[AsyncSession], engine: EngineClient, namespaces: Namespaces
) -> int:
    """Pin part 1 of every tenant that has ``pin_prefix`` on (at start); returns how many were pinned."""
    async with sessionmaker() as db:
        rows = await db.execute(select(Tenant).where(Tenant.pin_prefix.is_(True)))
        pinning = list(rows.scalars())
    return sum([await _pin_or_log(engine, namespaces, tenant) is not None for tenant in pinning])


async def _pin_or_log(engine: EngineClient, namespaces: Namespaces, tenant: Tenant) -> PinResult | None:
    try:
        return await pin(engine, namespaces, tenant)
    except PinRefusedError as exc:
        log.warning("tenant %s: %s", tenant.id, exc)
        return None


async def _tenant(db: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await db.get(Tenant, tenant_id)
    if tenant is None:
        raise TenantNotFoundError(f"no tenant {tenant_id}")
    return tenant


async def _record(
    db: AsyncSession,
    tenant_id: str,
    session_id: str | None,
    reason: InvalidationReason,
    blocks: int,
    tokens: int,
    actor: str = ADMIN_ACTOR,
) -> None:
    await context_store.record_invalidation(db, tenant_id, session_id, reason, actor, blocks, tokens)
    await db.commit()
