"""Admin: the tenant's own settings and keys (system prompt and policy text; rotate the chat token or the admin key),
whether ``/v1`` replies pass the contact guard, whether its replies decode with suffix drafts, its context-layer
settings, its cache settings (scope, prefix pinning), and a flush of its whole prefix cache.

The engine-global cache settings (TTLs, disk cap, eviction) are the operator's: ``admin_cache.py``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, StateDep, audit_note, audited
from backend.api.partial import merged, partial_model
from backend.api.routes.admin_sessions import PARTIAL, FlushOut, ReplicaOut, answer_partial
from backend.core.limits import SafeText
from backend.core.namespaces import CacheScope
from backend.db.models import ApiKey, Tenant
from backend.domain import DraftsSetting, HistoryPolicy, KeyKind, ReplicaErase
from backend.engine_client.replica_report import ReplicaReport, report_of
from backend.services import cache_admin, tenant_admin, tenants
from backend.services.cache_admin import PrefixEdit, TenantCache, TenantCacheChange
from backend.services.context_store import ContextSettings
from backend.services.tenant_admin import SettingsChange

router = APIRouter(prefix="/admin/tenant", tags=["admin: tenant"])


class TenantOut(BaseModel):
    id: str
    name: str
    system_prompt: str
    policy_text: str = Field(description="rendered right after the system prompt: together, every prompt's part 1")
    cache_scope: CacheScope
    pin_prefix: bool
    v1_contact_guard: bool = Field(description="/v1 replies pass the contact guard (chat replies always do)")
    drafts: DraftsSetting = Field(description="suffix drafts: on, off, or default (the engine's switch)")
    created_at: datetime

    @classmethod
    def of(cls, t: Tenant) -> TenantOut:
        return cls(
            id=t.id,
            name=t.name,
            system_prompt=t.system_prompt,
            policy_text=t.policy_text,
            cache_scope=CacheScope(t.cache_scope),
            pin_prefix=t.pin_prefix,
            v1_contact_guard=t.v1_contact_guard,
            drafts=DraftsSetting(t.drafts),
            created_at=t.created_at,
        )


class SystemPromptIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system_prompt: Annotated[SafeText, Field(max_length=100_000)]


class PolicyTextIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy_text: Annotated[SafeText, Field(max_length=100_000)]


class V1ContactGuardIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        description="replace URLs, e-mail addresses and phone numbers that neither the tenant's system prompt and "
        "policy text nor the request's messages hold (off by default: an API client may want raw output)"
    )


class DraftsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drafts: DraftsSetting = Field(
        description="suffix drafts for the tenant's chat replies and /v1 requests (a request's own `drafts` field "
        "wins): on, off, or default (the engine's switch, KVCHAT_ENGINE_DRAFTS). Verified exactly: the replies are "
        "the same either way, only their speed changes"
    )


class TenantCacheIO(BaseModel):
    """The tenant's own cache settings (``PUT`` replaces both)."""

    model_config = ConfigDict(extra="forbid")

    cache_scope: CacheScope = Field(
        description="private: the tenant's own cache namespace; public: the namespace shared by every tenant that "
        "opts in (their identical prompts share cached blocks, and can tell by timing what the others have cached)"
    )
    pin_prefix: bool = Field(
        description="keep the system prompt + policy text pinned in memory (needs cache_scope private; bounded by "
        "the operator's pinned share)"
    )
    replica_erase: ReplicaErase = Field(
        default=ReplicaErase.REPORT,
        description="erasing a session on an engine replica that has no per-session erase (vLLM): report (nothing "
        "is erased there; the erasure names the replica and answers 207) or reset_cache (that replica's whole "
        "prefix cache is reset: every session on it loses its cached prefixes). Omitted: report",
    )

    def change(self) -> TenantCacheChange:
        return TenantCacheChange(self.cache_scope, self.pin_prefix, self.replica_erase)


class TenantCacheOut(TenantCacheIO):
    pinned_blocks: int | None = Field(description="blocks this request pinned (None: nothing pinned by it)")
    pinned_cached: int | None = Field(description="of those, cached now; the rest are pinned once computed")
    pinned_replicas: list[ReplicaOut] = Field(
        description="each engine replica's outcome of this request's pin (a 207 when one did not pin); empty when "
        "nothing was pinned, or with the in-process engine"
    )

    @classmethod
    def of(cls, c: TenantCache) -> TenantCacheOut:
        p = c.pinned
        return cls(
            cache_scope=c.cache_scope,
            pin_prefix=c.pin_prefix,
            replica_erase=c.replica_erase,
            pinned_blocks=p.blocks if p else None,
            pinned_cached=p.cached if p else None,
            pinned_replicas=ReplicaOut.all_of(report_of(p)) if p else [],
        )


class KeyOut(BaseModel):
    id: str
    kind: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, k: ApiKey) -> KeyOut:
        return cls(id=k.id, kind=k.kind, prefix=k.prefix, created_at=k.created_at, revoked_at=k.revoked_at)


class RotateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: KeyKind


class IssuedKeyOut(BaseModel):
    id: str
    kind: str
    prefix: str
    key: str = Field(description="the new key: shown this once, only its hash is kept")


class ContextSettingsIO(BaseModel):
    """The tenant's context-layer settings (``PUT`` replaces them all; the next message uses them)."""

    model_config = ConfigDict(extra="forbid")

    history_policy: HistoryPolicy = Field(description="full, epoch (earlier topics reduced) or budget")
    shift_threshold: float = Field(
        ge=0, le=1, description="on-topic score (the scorer's) under which a message starts a new topic"
    )
    start_temperature: float = Field(ge=0, le=1)
    shift_temperature: float = Field(ge=0, le=1)
    min_block_length: int = Field(ge=1, le=4096, description="tokens; shorter fragments are merged")
    similarity_backend: Literal["clf-static", "clf-minilm", "minilm", "tfidf", "none"] = Field(
        description="the topic scorer (backend/context/scorers.py): clf-static reads meaning (the default)"
    )

    @classmethod
    def of(cls, s: ContextSettings) -> ContextSettingsIO:
        t = s.topic
        return cls(
            history_policy=s.history_policy,
            shift_threshold=t.shift_threshold,
            start_temperature=t.start_temperature,
            shift_temperature=t.shift_temperature,
            min_block_length=s.min_block_length,
            similarity_backend=t.backend,  # type: ignore[arg-type]
        )

    def change(self) -> SettingsChange:
        return SettingsChange(
            self.history_policy,
            self.shift_threshold,
            self.start_temperature,
            self.shift_temperature,
            self.min_block_length,
            self.similarity_backend,
        )


TenantCachePatch = partial_model(TenantCacheIO)
ContextSettingsPatch = partial_model(ContextSettingsIO)


@router.get("", response_model=TenantOut)
async def get_tenant(tenant: AdminDep) -> TenantOut:
    return TenantOut.of(tenant)


@router.put("/system-prompt", response_model=TenantOut, dependencies=[audited("tenant.system_prompt")])
async def set_system_prompt(
    body: SystemPromptIn, tenant: AdminDep, db: DbDep, state: StateDep, request: Request
) -> TenantOut:
    """Replace the system prompt every session of the tenant starts with (the next turn of every session uses it).

    The tenant's cached blocks all depend on it and are freed (a private namespace); a pinned prefix is pinned anew.
    """
    edit = await tenant_admin.set_system_prompt(db, state.engine, state.namespaces, tenant.id, body.system_prompt)
    return _edited(request, edit)


@router.put("/policy-text", response_model=TenantOut, dependencies=[audited("tenant.policy_text")])
async def set_policy_text(
    body: PolicyTextIn, tenant: AdminDep, db: DbDep, state: StateDep, request: Request
) -> TenantOut:
    """Replace the policy text rendered right after the system prompt in every prompt (the next turn uses it); the
    cache follows as for the system prompt."""
    edit = await tenant_admin.set_policy_text(db, state.engine, state.namespaces, tenant.id, body.policy_text)
    return _edited(request, edit)


@router.put("/v1-contact-guard", response_model=TenantOut, dependencies=[audited("tenant.v1_contact_guard")])
async def set_v1_contact_guard(body: V1ContactGuardIn, tenant: AdminDep, db: DbDep) -> TenantOut:
    """Turn the contact guard on ``/v1/chat/completions`` on or off (the next request uses it)."""
    return TenantOut.of(await tenant_admin.set_v1_contact_guard(db, tenant.id, body.enabled))


@router.put("/drafts", response_model=TenantOut, dependencies=[audited("tenant.drafts")])
async def set_drafts(body: DraftsIn, tenant: AdminDep, db: DbDep) -> TenantOut:
    """Turn suffix drafts on or off for the tenant, or follow the engine's switch (the next turn and request use it)."""
    return TenantOut.of(await tenant_admin.set_drafts(db, tenant.id, body.drafts))


def _edited(request: Request, edit: PrefixEdit) -> TenantOut:
    audit_note(request, edit.describe())
    return TenantOut.of(edit.tenant)


@router.get("/cache", response_model=TenantCacheOut)
async def get_tenant_cache(tenant: AdminDep, db: DbDep) -> TenantCacheOut:
    return TenantCacheOut.of(await cache_admin.tenant_cache(db, tenant.id))


@router.put(
    "/cache",
    response_model=TenantCacheOut,
    dependencies=[audited("tenant.cache")],
    responses={409: {"description": "pin_refused: the prefix is over the operator's pinned share"}, **PARTIAL},
)
async def set_tenant_cache(
    body: TenantCacheIO, tenant: AdminDep, db: DbDep, state: StateDep, request: Request, response: Response
) -> TenantCacheOut:
    """Choose the tenant's cache namespace (private, or the shared public one), whether its prefix is pinned, and
    how a session is erased on a replica without a per-session erase."""
    cache = await cache_admin.set_tenant_cache(db, state.engine, state.namespaces, tenant.id, body.change())
    if cache.pinned is not None:
        report = report_of(cache.pinned)
        answer_partial(request, response, report, f"pinned {cache.pinned.blocks} blocks" + _gaps(report, "pinned"))
    return TenantCacheOut.of(cache)


@router.patch(
    "/cache",
    response_model=TenantCacheOut,
    dependencies=[audited("tenant.cache")],
    responses={409: {"description": "pin_refused: the prefix is over the operator's pinned share"}, **PARTIAL},
)
async def patch_tenant_cache(
    body: TenantCachePatch,  # type: ignore[valid-type]
    tenant: AdminDep,
    db: DbDep,
    state: StateDep,
    request: Request,
    response: Response,
) -> TenantCacheOut:
    """Change the cache settings given; the others keep their value."""
    current = await get_tenant_cache(tenant, db)
    return await set_tenant_cache(merged(current, body, TenantCacheIO), tenant, db, state, request, response)


def _gaps(report: ReplicaReport, what: str) -> str:
    return f"; {report.describe(what)}" if not report.complete else ""


@router.get("/keys", response_model=list[KeyOut])
async def list_keys(tenant: AdminDep, db: DbDep) -> list[KeyOut]:
    """The tenant's keys (prefixes only; a key is never shown again after it was issued)."""
    return [KeyOut.of(k) for k in await tenants.list_keys(db, tenant.id)]


@router.post("/keys/rotate", response_model=IssuedKeyOut, dependencies=[audited("key.rotate")])
async def rotate_key(body: RotateIn, tenant: AdminDep, db: DbDep, state: StateDep) -> IssuedKeyOut:
    """Revoke every active key of ``kind`` (``chat`` or ``admin``) and issue a new one, shown once. The websockets
    opened with a revoked key are closed (4401 "key revoked")."""
    issued = await tenant_admin.rotate_key(db, tenant.id, body.kind, state.chat.hub.keys)
    return IssuedKeyOut(id=issued.id, kind=issued.kind.value, prefix=issued.prefix, key=issued.key)


@router.post("/keys/{key_id}/revoke", response_model=KeyOut, dependencies=[audited("key.revoke")])
async def revoke_key(
    key_id: Annotated[SafeText, Path(max_length=36)], tenant: AdminDep, db: DbDep, state: StateDep
) -> KeyOut:
    """Revoke one of the tenant's keys: its requests are refused from now on, and the websockets it opened are
    closed (4401 "key revoked"); a ``/v1`` stream already running finishes."""
    return KeyOut.of(await tenant_admin.revoke_key(db, tenant.id, key_id, state.chat.hub.keys))


@router.get("/context-settings", response_model=ContextSettingsIO)
async def get_context_settings(tenant: AdminDep, db: DbDep) -> ContextSettingsIO:
    return ContextSettingsIO.of(await tenant_admin.load_settings(db, tenant.id))


@router.put("/context-settings", response_model=ContextSettingsIO, dependencies=[audited("tenant.context_settings")])
async def set_context_settings(body: ContextSettingsIO, tenant: AdminDep, db: DbDep) -> ContextSettingsIO:
    """Replace the tenant's context settings; the next message of every session uses them."""
    return ContextSettingsIO.of(await tenant_admin.save_settings(db, tenant.id, body.change()))


@router.patch("/context-settings", response_model=ContextSettingsIO, dependencies=[audited("tenant.context_settings")])
async def patch_context_settings(
    body: ContextSettingsPatch,  # type: ignore[valid-type]
    tenant: AdminDep,
    db: DbDep,
) -> ContextSettingsIO:
    """Change the context settings given; the others keep their value."""
    current = await get_context_settings(tenant, db)
    return await set_context_settings(merged(current, body, ContextSettingsIO), tenant, db)


@router.post(
    "/flush",
    response_model=FlushOut,
    dependencies=[audited("tenant.flush")],
    responses={409: {"description": "namespace_shared: the tenant uses the public namespace"}, **PARTIAL},
)
async def flush_tenant(tenant: AdminDep, db: DbDep, state: StateDep, request: Request, response: Response) -> FlushOut:
    """Free every cached KV block of the tenant (blocks a reply in flight holds go when it ends)."""
    freed = await cache_admin.flush_tenant(db, state.engine, state.namespaces, tenant)
    describe = cache_admin.describe_flush(freed, "the tenant's whole namespace")
    answer_partial(request, response, report_of(freed), describe)
    return FlushOut.of(freed)
