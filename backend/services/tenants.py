"""Tenants and their API keys: first-start bootstrap, creation, key issue / rotation / revocation, authentication.

A key is shown once, when it is issued; only its sha256 is stored (``backend/core/security.py``). Rotating or
revoking a key announces it in the same transaction (``revocation.announce_revoked``), so the live connections opened
with it are closed in every server process once the transaction commits.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.context.handbook import Section, parse_markdown
from backend.core.errors import KeyNotFoundError, KeyRevokedError, TenantExistsError, TenantNotFoundError
from backend.core.security import display_prefix, generate_key, hash_key
from backend.db.models import ApiKey, HandbookSection, Tenant, utcnow
from backend.domain import DraftsSetting, KeyKind
from backend.services.inbox_errors import AgentKeyKindError
from backend.services.revocation import announce_revoked

DEFAULT_TENANT = "default"
DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly, concise customer-service assistant. Answer from the store's policies; "
    "if you cannot help, offer to connect the customer with a human agent."
)
# The default tenant's first handbook (``KVCHAT_DEFAULT_HANDBOOK``: ``builtin``, a Markdown file, or ``none``).
BUILTIN_HANDBOOK = Path(__file__).resolve().parent.parent / "context" / "default_handbook.md"


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    tenant_id: str
    created: bool
    generated_chat_token: str | None  # set only when the key was generated now (print it once)
    generated_admin_key: str | None


async def bootstrap_default_tenant(
    sessionmaker: async_sessionmaker[AsyncSession],
    chat_token: str | None,
    admin_key: str | None,
    handbook: Sequence[Section] = (),
) -> BootstrapResult:
    """Create the default tenant (with ``handbook``) and its keys on a fresh install; make configured keys valid on
    every start."""
    async with sessionmaker() as db, db.begin():
        tenant = (await db.execute(select(Tenant).where(Tenant.name == DEFAULT_TENANT))).scalar_one_or_none()
        created = tenant is None
        if tenant is None:
            tenant = Tenant(
                name=DEFAULT_TENANT, system_prompt=DEFAULT_SYSTEM_PROMPT, handbook_version=1 if handbook else 0
            )
            db.add(tenant)
            await db.flush()
            for position, s in enumerate(handbook):
                db.add(
                    HandbookSection(
                        tenant_id=tenant.id,
                        position=position,
                        title=s.title,
                        text=s.text,
                        content_hash=s.content_hash,
                        examples=json.dumps(list(s.examples)),
                        version=1,
                    )
                )
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


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A new key: ``key`` is the only time the secret is seen; store it now."""

    id: str
    kind: KeyKind
    key: str
    prefix: str
    revoked: tuple[str, ...] = ()  # the ids of the keys a rotation revoked


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """Who a key authenticates: its tenant, and the key's id (the live connections opened with it are watched)."""

    tenant: Tenant
    key_id: str


async def create_tenant(db: AsyncSession, name: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> Tenant:
    """Add a tenant (flushed, so its id is set; the caller commits). Give it keys with ``issue_key``."""
    if (await db.execute(select(Tenant.id).where(Tenant.name == name))).first() is not None:
        raise TenantExistsError(f"a tenant named {name!r} already exists")
    tenant = Tenant(name=name, system_prompt=system_prompt)
    db.add(tenant)
    try:
        await db.flush()
    except IntegrityError as exc:  # a concurrent create won the race for the name
        raise TenantExistsError(f"a tenant named {name!r} already exists") from exc
    return tenant


async def get_tenant(db: AsyncSession, id_or_name: str) -> Tenant:
    """A tenant by id or by name."""
    row = await db.execute(select(Tenant).where((Tenant.id == id_or_name) | (Tenant.name == id_or_name)))
    tenant = row.scalars().first()
    if tenant is None:
        raise TenantNotFoundError(f"no tenant {id_or_name!r}")
    return tenant


async def list_tenants(db: AsyncSession) -> list[Tenant]:
    return list((await db.execute(select(Tenant).order_by(Tenant.created_at, Tenant.name))).scalars())


async def set_system_prompt(db: AsyncSession, tenant_id: str, system_prompt: str) -> Tenant:
    tenant = await get_tenant(db, tenant_id)
    tenant.system_prompt = system_prompt
    await db.flush()
    return tenant


async def set_policy_text(db: AsyncSession, tenant_id: str, policy_text: str) -> Tenant:
    tenant = await get_tenant(db, tenant_id)
    tenant.policy_text = policy_text
    await db.flush()
    return tenant


async def set_v1_contact_guard(db: AsyncSession, tenant_id: str, enabled: bool) -> Tenant:
    tenant = await get_tenant(db, tenant_id)
    tenant.v1_contact_guard = enabled
    await db.flush()
    return tenant


async def set_drafts(db: AsyncSession, tenant_id: str, drafts: DraftsSetting) -> Tenant:
    tenant = await get_tenant(db, tenant_id)
    tenant.drafts = drafts.value
    await db.flush()
    return tenant


async def issue_key(db: AsyncSession, tenant_id: str, kind: KeyKind, agent_id: str | None = None) -> IssuedKey:
    """Generate a key for the tenant (flushed; the caller commits); an ``agent`` key names its person
    (``backend/services/agents.py``)."""
    if (kind == KeyKind.AGENT) != (agent_id is not None):
        raise AgentKeyKindError("an agent key is issued for an agent (backend/services/agents.py), and only it")
    key = generate_key(kind)
    row = ApiKey(
        tenant_id=tenant_id, kind=kind.value, key_hash=hash_key(key), prefix=display_prefix(key), agent_id=agent_id
    )
    db.add(row)
    await db.flush()
    return IssuedKey(row.id, kind, key, row.prefix)


async def rotate_key(db: AsyncSession, tenant_id: str, kind: KeyKind) -> IssuedKey:
    """Revoke every active key of ``kind`` and issue one new key, in the caller's transaction (an agent's keys are
    rotated per agent: ``agents.rotate_agent_key``)."""
    if kind == KeyKind.AGENT:
        raise AgentKeyKindError("agent keys are rotated per agent: POST /admin/tenant/agents/{agent_id}/rotate")
    revoked = await db.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant_id, ApiKey.kind == kind.value, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .returning(ApiKey.id)
    )
    ids = tuple(revoked.scalars())
    await announce_revoked(db, ids)
    issued = await issue_key(db, tenant_id, kind)
    return dataclasses.replace(issued, revoked=ids)


async def revoke_key(db: AsyncSession, key_id: str, tenant_id: str | None = None) -> ApiKey:
    """Revoke a key by id (within ``tenant_id`` when given). Revoking twice is not an error (an API retry)."""
    key = await _key(db, key_id, tenant_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        await db.flush()
        await announce_revoked(db, [key.id])
    return key


async def revoke_live_key(db: AsyncSession, key_id: str) -> ApiKey:
    """Revoke a key that is still live: ``KeyRevokedError`` when it was revoked already (``kvchat keys revoke``: an
    operator who typed a stale id must hear that nothing changed)."""
    key = await _key(db, key_id, None)
    if key.revoked_at is not None:
        raise KeyRevokedError(f"key {key_id!r} was already revoked ({key.revoked_at:%Y-%m-%d %H:%M} UTC)")
    return await revoke_key(db, key_id)


async def _key(db: AsyncSession, key_id: str, tenant_id: str | None) -> ApiKey:
    query = select(ApiKey).where(ApiKey.id == key_id)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    key = (await db.execute(query)).scalar_one_or_none()
    if key is None:
        raise KeyNotFoundError(f"no key {key_id!r}")
    return key


async def list_keys(db: AsyncSession, tenant_id: str) -> list[ApiKey]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.kind)
    return list((await db.execute(query)).scalars())


async def add_key(db: AsyncSession, tenant_id: str, kind: KeyKind, key: str) -> None:
    digest = hash_key(key)
    existing = (await db.execute(select(ApiKey).where(ApiKey.key_hash == digest))).scalar_one_or_none()
    if existing is None:
        db.add(ApiKey(tenant_id=tenant_id, kind=kind.value, key_hash=digest, prefix=display_prefix(key)))


async def authenticate(db: AsyncSession, key: str, kind: KeyKind) -> Tenant | None:
    """The tenant owning ``key`` for ``kind`` (chat or admin), or None. Revoked keys never authenticate."""
    owner = await authenticate_key(db, key, kind)
    return owner.tenant if owner is not None else None


async def authenticate_key(db: AsyncSession, key: str, kind: KeyKind) -> KeyOwner | None:
    """``authenticate``, with the key's id."""
    if not key:
        return None
    digest = hash_key(key)
    # NOTE: looked up by the key's sha256, so how long the lookup takes says nothing about the key itself; the
    # digest is compared once more in constant time, so no comparison of ours ever ends early on a secret.
    row = await db.execute(
        select(Tenant, ApiKey.key_hash, ApiKey.id)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest, ApiKey.kind == kind.value, ApiKey.revoked_at.is_(None))
    )
    found = row.first()
    if found is None or not hmac.compare_digest(found[1], digest):
        return None
    return KeyOwner(found[0], found[2])


def default_handbook(setting: str) -> list[Section]:
    """The default tenant's first handbook: ``builtin`` (``BUILTIN_HANDBOOK``), a Markdown file's path, or ``none``."""
    if setting == "none":
        return []
    path = BUILTIN_HANDBOOK if setting == "builtin" else Path(setting)
    return parse_markdown(path.read_text(encoding="utf-8"))
