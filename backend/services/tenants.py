"""Tenants and their API keys: first-start bootstrap and key authentication."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.core.security import display_prefix, generate_key, hash_key
from backend.db.models import ApiKey, KeyKind, Tenant

DEFAULT_TENANT = "default"
DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly, concise customer-service assistant. Answer from the store's policies; "
    "if you cannot help, offer to connect the customer with a human agent."
)


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    tenant_id: str
    created: bool
    generated_chat_token: str | None  # set only when the key was generated now (print it once)
    generated_admin_key: str | None


async def bootstrap_default_tenant(
    sessionmaker: async_sessionmaker[AsyncSession], chat_token: str | None, admin_key: str | None
) -> BootstrapResult:
    """Create the default tenant and its keys on a fresh install; make configured keys valid on every start."""
    async with sessionmaker() as db, db.begin():
        tenant = (await db.execute(select(Tenant).where(Tenant.name == DEFAULT_TENANT))).scalar_one_or_none()
        created = tenant is None
        if tenant is None:
            tenant = Tenant(name=DEFAULT_TENANT, system_prompt=DEFAULT_SYSTEM_PROMPT)
            db.add(tenant)
            await db.flush()
        generated: dict[KeyKind, str | None] = {}
        for kind, configured in ((KeyKind.CHAT, chat_token), (KeyKind.ADMIN, admin_key)):
            generated[kind] = await _ensure_key(db, tenant.id, kind, configured, generate_if_missing=created)
    return BootstrapResult(tenant.id, created, generated[KeyKind.CHAT], generated[KeyKind.ADMIN])


async def _ensure_key(
    db: AsyncSession, tenant_id: str, kind: KeyKind, configured: str | None, *, generate_if_missing: bool
) -> str | None:
    if configured:
        await add_key(db, tenant_id, kind, configured)
        return None
    if not generate_if_missing:
        return None
    key = generate_key(kind)
    await add_key(db, tenant_id, kind, key)
    return key


async def create_tenant(db: AsyncSession, name: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> Tenant:
    """Add a tenant (flushed, so its id is set; the caller commits). Give it keys with ``add_key``."""
    tenant = Tenant(name=name, system_prompt=system_prompt)
    db.add(tenant)
    await db.flush()
    return tenant


async def add_key(db: AsyncSession, tenant_id: str, kind: KeyKind, key: str) -> None:
    digest = hash_key(key)
    existing = (await db.execute(select(ApiKey).where(ApiKey.key_hash == digest))).scalar_one_or_none()
    if existing is None:
        db.add(ApiKey(tenant_id=tenant_id, kind=kind.value, key_hash=digest, prefix=display_prefix(key)))


async def authenticate(db: AsyncSession, key: str, kind: KeyKind) -> Tenant | None:
    """The tenant owning ``key`` for ``kind`` (chat or admin), or None. Revoked keys never authenticate."""
    if not key:
        return None
    row = await db.execute(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.kind == kind.value, ApiKey.revoked_at.is_(None))
    )
    return row.scalar_one_or_none()
