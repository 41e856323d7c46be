"""Admin: the tenant's splitter rules. Global rules are listed read-only; the tenant adds, edits, disables and
deletes its own, and shadows a global rule by adding one of the same name. A pattern is RE2 syntax: one that RE2
refuses (a lookaround, a backreference), that compiles too large, or that can match the empty string is a 422
``invalid_rule`` naming the rule and the reason; one that would take the tenant's own rules past a cap (their
number, ``KVCHAT_MAX_RULES_PER_TENANT``, or their compiled size, ``KVCHAT_MAX_RULES_PROGRAM_SIZE``) is a 422
``rule_limit``. The chat uses the change from the next message.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Response, status
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, SettingsDep, audited
from backend.api.partial import merged, partial_model
from backend.context.blocks import BlockType
from backend.context.rules import Rule
from backend.core.config import Settings
from backend.core.limits import INT32_MAX, Identifier, SafeText
from backend.db.models import SplitterRule
from backend.services import tenant_admin
from backend.services.tenant_admin import RuleLimits

router = APIRouter(prefix="/admin/rules", tags=["admin: rules"])

READ_ONLY: dict[int | str, dict[str, Any]] = {
    403: {"description": "a global rule (rule_read_only): shadow it by adding one of the same name"}
}
NAME_TAKEN: dict[int | str, dict[str, Any]] = {
    409: {"description": "the tenant already has a rule of that name (rule_exists)"}
}

RuleIdPath = Annotated[int, Path(ge=1, le=INT32_MAX, description="the rule's id")]


class RuleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Identifier = Field(description="a global rule's name replaces that rule for this tenant")
    pattern: Annotated[SafeText, Field(min_length=1, max_length=2000)] = Field(description="an RE2 regex")
    block_type: BlockType
    priority: int = Field(ge=-1000, le=1000, description="the highest priority among matching rules wins")
    language: Literal["en", "zh", "any"] = "any"
    enabled: bool = True

    def rule(self) -> Rule:
        return Rule(self.name, self.pattern, self.block_type, self.priority, self.language, self.enabled)


class RuleOut(BaseModel):
    id: int
    scope: Literal["global", "tenant"]  # global rules are read-only
    name: str
    pattern: str
    block_type: str
    priority: int
    language: str
    enabled: bool
    updated_at: datetime

    @classmethod
    def of(cls, r: SplitterRule) -> RuleOut:
        return cls(
            id=r.id,
            scope="global" if r.tenant_id is None else "tenant",
            name=r.name,
            pattern=r.pattern,
            block_type=r.block_type,
            priority=r.priority,
            language=r.language,
            enabled=r.enabled,
            updated_at=r.updated_at,
        )


@router.get("", response_model=list[RuleOut])
async def list_rules(tenant: AdminDep, db: DbDep) -> list[RuleOut]:
    """The global rules, then the tenant's own (a tenant rule shadows the global rule of the same name)."""
    return [RuleOut.of(r) for r in await tenant_admin.list_rules(db, tenant.id)]


@router.post(
    "",
    response_model=RuleOut,
    status_code=status.HTTP_201_CREATED,
    responses=NAME_TAKEN,
    dependencies=[audited("rule.create")],
)
async def create_rule(body: RuleIn, tenant: AdminDep, db: DbDep, settings: SettingsDep) -> RuleOut:
    return RuleOut.of(await tenant_admin.create_rule(db, tenant.id, body.rule(), _limits(settings)))


@router.put(
    "/{rule_id}", response_model=RuleOut, responses={**READ_ONLY, **NAME_TAKEN}, dependencies=[audited("rule.update")]
)
async def update_rule(rule_id: RuleIdPath, body: RuleIn, tenant: AdminDep, db: DbDep, settings: SettingsDep) -> RuleOut:
    """Replace one of the tenant's rules (``enabled: false`` disables it)."""
    return RuleOut.of(await tenant_admin.update_rule(db, tenant.id, rule_id, body.rule(), _limits(settings)))


RulePatch = partial_model(RuleIn)


@router.patch(
    "/{rule_id}", response_model=RuleOut, responses={**READ_ONLY, **NAME_TAKEN}, dependencies=[audited("rule.update")]
)
async def patch_rule(
    rule_id: RuleIdPath,
    body: RulePatch,  # type: ignore[valid-type]
    tenant: AdminDep,
    db: DbDep,
    settings: SettingsDep,
) -> RuleOut:
    """Change the fields given (e.g. ``{"enabled": false}``); the others keep their value."""
    current = RuleOut.of(await tenant_admin.own_rule(db, tenant.id, rule_id))
    return await update_rule(rule_id, merged(current, body, RuleIn), tenant, db, settings)


@router.delete(
    "/{rule_id}", status_code=status.HTTP_204_NO_CONTENT, responses=READ_ONLY, dependencies=[audited("rule.delete")]
)
async def delete_rule(rule_id: RuleIdPath, tenant: AdminDep, db: DbDep) -> Response:
    await tenant_admin.delete_rule(db, tenant.id, rule_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _limits(settings: Settings) -> RuleLimits:
    return RuleLimits(settings.max_rules_per_tenant, settings.max_rules_program_size)
