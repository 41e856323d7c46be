"""What a tenant's admin does to the engine's prefix cache: flush one session's blocks or the whole tenant's. Each
flush is stored as an ``invalidation_events`` row (reason ``admin_flush``).

The tenant's id is its cache namespace, so a tenant's flush never reaches another tenant's blocks.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from backend.db.models import InvalidationReason
from backend.services import context_store
from backend.services import sessions as store
from engine.kv.kv_cache_manager import InvalidationResult
from engine.llm_engine import LLMEngine

ADMIN_ACTOR = "admin"


async def flush_session(db: AsyncSession, engine: LLMEngine, tenant_id: str, session_id: str) -> InvalidationResult:
    """Free the session's cached blocks (its whole chain; what other sessions use stays). The session stays open.

    NOTE: from position 0: the chain's first block is the tenant's system prompt, kept anyway while another session
    lists it (``LLMEngine.invalidate`` protects other sessions' chains and running requests).
    """
    await store.get_session(db, tenant_id, session_id)
    reason = InvalidationReason.ADMIN_FLUSH
    result = engine.invalidate(tenant_id, session=session_id, from_position=0, reason=reason.value)
    await _record(db, tenant_id, session_id, result)
    return result


async def flush_tenant(db: AsyncSession, engine: LLMEngine, tenant_id: str) -> InvalidationResult:
    """Free every cached block of the tenant's namespace (blocks in flight go when their request ends)."""
    result = engine.flush_namespace(tenant_id, reason=InvalidationReason.ADMIN_FLUSH.value)
    await _record(db, tenant_id, None, result)
    return result


async def _record(db: AsyncSession, tenant_id: str, session_id: str | None, result: InvalidationResult) -> None:
    reason = InvalidationReason.ADMIN_FLUSH
    await context_store.record_invalidation(
        db, tenant_id, session_id, reason, ADMIN_ACTOR, result.blocks_freed, result.tokens_freed
    )
    await db.commit()
