"""Operator: the engine-global cache settings at runtime (TTLs per tier, disk cap, free-space floor, eviction policy,
block-type weights, pinned share), and the operator's audit trail.

NOTE: not a tenant's: one engine serves every tenant, so these routes take the operator's credential
(``KVCHAT_OPERATOR_TOKEN`` as a bearer token; unset, loopback clients only), never a tenant's admin key. A change lasts
until the process stops; the ``KVCHAT_KV_*`` settings give the values a start begins with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import DbDep, OperatorDep, StateDep, audit_note, operator_audited
from backend.api.routes.admin_audit import AuditOut
from backend.core.limits import QueryOffset
from backend.engine_client.values import CacheSettings
from backend.services import audit, cache_settings

router = APIRouter(prefix="/admin/cache", tags=["operator: cache"])
_OPERATOR: dict[int | str, dict[str, Any]] = {
    401: {"description": "KVCHAT_OPERATOR_TOKEN is set and the request does not carry it"},
    403: {"description": "no KVCHAT_OPERATOR_TOKEN is set and the client is not on this machine"},
}

BlockType = Annotated[str, Field(min_length=1, max_length=64)]


class CacheSettingsOut(BaseModel):
    memory_ttl_s: float = Field(description="an idle block moves from memory to disk after this many seconds")
    disk_ttl_s: float = Field(description="an untouched block leaves the disk after this many seconds")
    disk_cache_max_gb: float = Field(description="size cap of the disk tier (least recently used files go first)")
    min_free_space_gb: float = Field(description="below this much free disk space, disk writes are refused")
    eviction_policy: Literal["weighted", "lru"] = Field(
        description="lru: recency only (the default); weighted: session temperature, block type and recency"
    )
    type_weights: dict[str, float] = Field(description="block type → weight (higher stays longer)")
    pin_max_fraction: float = Field(description="the share of the memory pool all pinned prefixes may hold")

    @classmethod
    def of(cls, s: CacheSettings) -> CacheSettingsOut:
        return cls(
            memory_ttl_s=s.memory_ttl_s,
            disk_ttl_s=s.disk_ttl_s,
            disk_cache_max_gb=s.disk_cache_max_gb,
            min_free_space_gb=s.min_free_space_gb,
            eviction_policy=s.eviction_policy,  # type: ignore[arg-type]
            type_weights=dict(s.type_weights),
            pin_max_fraction=s.pin_max_fraction,
        )


class CacheSettingsIn(BaseModel):
    """The settings to change; those left out keep their value. ``type_weights`` is merged into the current map."""

    model_config = ConfigDict(extra="forbid")

    memory_ttl_s: float | None = Field(default=None, gt=0, le=365 * 86_400)
    disk_ttl_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86_400)
    disk_cache_max_gb: float | None = Field(default=None, gt=0, le=1_000_000)
    min_free_space_gb: float | None = Field(default=None, ge=0, le=1_000_000)
    eviction_policy: Literal["weighted", "lru"] | None = None
    type_weights: Annotated[dict[BlockType, Annotated[float, Field(ge=0, le=100)]], Field(max_length=64)] | None = None
    pin_max_fraction: float | None = Field(default=None, ge=0, le=0.9)

    def changes(self) -> Mapping[str, object]:
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}


@router.get("/settings", response_model=CacheSettingsOut, responses=_OPERATOR)
async def get_cache_settings(_: OperatorDep, state: StateDep) -> CacheSettingsOut:
    """The cache settings in force now."""
    return CacheSettingsOut.of(await cache_settings.current(state.engine))


@router.patch(
    "/settings",
    response_model=CacheSettingsOut,
    dependencies=[operator_audited("cache.settings")],
    responses={**_OPERATOR, 422: {"description": "invalid_cache_settings: the engine refused a value (why)"}},
)
@router.put(
    "/settings",
    response_model=CacheSettingsOut,
    dependencies=[operator_audited("cache.settings")],
    responses={**_OPERATOR, 422: {"description": "invalid_cache_settings: the engine refused a value (why)"}},
)
async def set_cache_settings(body: CacheSettingsIn, state: StateDep, request: Request) -> CacheSettingsOut:
    """Change cache settings without a restart (every tenant's: operator only). Returns the settings now in force."""
    changes = body.changes()
    audit_note(request, cache_settings.describe(changes))
    return CacheSettingsOut.of(await cache_settings.configure(state.engine, changes))


@router.get("/audit", response_model=list[AuditOut], responses=_OPERATOR)
async def list_operator_audit(
    _: OperatorDep,
    db: DbDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[QueryOffset, Query()] = 0,
) -> list[AuditOut]:
    """The operator's actions (cache settings changes), newest first."""
    return [AuditOut.of(a) for a in await audit.list_entries(db, None, limit, offset)]
