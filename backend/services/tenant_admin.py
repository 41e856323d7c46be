"""What a tenant's admin changes of its own: system prompt, policy text and keys, splitter rules and context settings,
the ``/v1`` contact guard and suffix drafts.

A tenant reads the global rules (``tenant_id`` NULL) and its own; it writes only its own. A tenant rule named like a
global one shadows it (``context_store.load_rules``), which is how a default is switched off or changed. Every rule
is compiled before it is stored (``InvalidRuleError`` says why one is refused), in the tenant's turn on the CPU
workers, and the tenant's own rules are capped (``RuleLimits``: their number, and their RE2 programs' summed size,
which bounds what they cost per message; ``RuleLimitError``). The chat picks changes up on the next message:
``RuleSetCache`` recompiles when the rules' count or latest ``updated_at`` moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.context.blocks import BlockType
from backend.context.errors import RuleLimitError
from backend.context.rules import CompiledRule, Rule, compile_rule, program_sizes
from backend.context.topic import TopicSettings
from backend.core.errors import RuleExistsError, RuleNotFoundError, RuleReadOnlyError
from backend.core.namespaces import Namespaces
from backend.core.offload import run_cpu
from backend.db.models import ApiKey, SplitterRule, Tenant
from backend.domain import DraftsSetting, HistoryPolicy, KeyKind
from backend.engine_client.protocol import EngineClient
from backend.services import cache_admin, context_store, tenants
from backend.services.cache_admin import PrefixEdit
from backend.services.context_store import ContextSettings
from backend.services.revocation import KeyWatch
from backend.services.tenants import IssuedKey


@dataclass(frozen=True, slots=True)
class RuleLimits:
    """Caps on a tenant's own rules (``KVCHAT_MAX_RULES_PER_TENANT``, ``KVCHAT_MAX_RULES_PROGRAM_SIZE``)."""

    max_rules: int
    max_program_size: int


@dataclass(frozen=True, slots=True)
class SettingsChange:
    """Every context setting an admin can set (the whole set, as ``PUT`` replaces it)."""

    history_policy: HistoryPolicy
    shift_threshold: float
    start_temperature: float
    shift_temperature: float
    min_block_length: int
    similarity_backend: str


async def set_system_prompt(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant_id: str, system_prompt: str
) -> PrefixEdit:
    """Replace the system prompt every session of the tenant starts with (the next turn of every session uses it);
    the cached blocks that depended on the old one are freed, and the new prefix is pinned when the tenant pins."""
    tenant = await tenants.set_system_prompt(db, tenant_id, system_prompt)
    await db.commit()
    return await cache_admin.prefix_edited(db, engine, namespaces, tenant)


async def set_policy_text(
    db: AsyncSession, engine: EngineClient, namespaces: Namespaces, tenant_id: str, policy_text: str
) -> PrefixEdit:
    """Replace the policy text rendered right after the system prompt; the cache follows as for the system prompt."""
    tenant = await tenants.set_policy_text(db, tenant_id, policy_text)
    await db.commit()
    return await cache_admin.prefix_edited(db, engine, namespaces, tenant)


async def set_v1_contact_guard(db: AsyncSession, tenant_id: str, enabled: bool) -> Tenant:
    """Whether ``/v1`` replies pass the contact guard (the next request uses it); nothing cached depends on it."""
    tenant = await tenants.set_v1_contact_guard(db, tenant_id, enabled)
    await db.commit()
    return tenant


async def set_drafts(db: AsyncSession, tenant_id: str, drafts: DraftsSetting) -> Tenant:
    """Whether the tenant's replies decode with suffix drafts (the next turn and ``/v1`` request use it; a ``/v1``
    request's own ``drafts`` field wins). Drafts are verified exactly: the replies are the same either way."""
    tenant = await tenants.set_drafts(db, tenant_id, drafts)
    await db.commit()
    return tenant


async def rotate_key(db: AsyncSession, tenant_id: str, kind: KeyKind, watch: KeyWatch) -> IssuedKey:
    """Issue a new key of ``kind`` and revoke the old ones; the sockets they opened are closed (this process's at
    once, the other processes' when the commit's notification reaches them)."""
    issued = await tenants.rotate_key(db, tenant_id, kind)
    await db.commit()
    watch.revoked(issued.revoked)
    return issued


async def revoke_key(db: AsyncSession, tenant_id: str, key_id: str, watch: KeyWatch) -> ApiKey:
    key = await tenants.revoke_key(db, key_id, tenant_id)
    await db.commit()
    watch.revoked([key.id])
    return key


async def list_rules(db: AsyncSession, tenant_id: str) -> list[SplitterRule]:
    """The global rules, then the tenant's own, each by name."""
    rows = await db.execute(
        select(SplitterRule)
        .where(or_(SplitterRule.tenant_id.is_(None), SplitterRule.tenant_id == tenant_id))
        .order_by(SplitterRule.tenant_id.is_not(None), SplitterRule.name, SplitterRule.id)
    )
    return list(rows.scalars())


async def create_rule(db: AsyncSession, tenant_id: str, rule: Rule, limits: RuleLimits) -> SplitterRule:
    compiled = await run_cpu(tenant_id, compile_rule, rule)  # NOTE: first, so a bad pattern is reported as such
    await _check_name_free(db, tenant_id, rule.name, None)
    await _check_limits(db, tenant_id, compiled, None, limits)
    rule_id = await context_store.add_rule(db, rule, tenant_id)
    await db.commit()
    return await _own_rule(db, tenant_id, rule_id)


async def update_rule(db: AsyncSession, tenant_id: str, rule_id: int, rule: Rule, limits: RuleLimits) -> SplitterRule:
    row = await _own_rule(db, tenant_id, rule_id)
    compiled = await run_cpu(tenant_id, compile_rule, rule)
    await _check_name_free(db, tenant_id, rule.name, rule_id)
    await _check_limits(db, tenant_id, compiled, rule_id, limits)
    row.name = rule.name
    row.pattern = rule.pattern
    row.block_type = rule.block_type.value
    row.priority = rule.priority
    row.language = rule.language
    row.enabled = rule.enabled
    await db.commit()
    await db.refresh(row)
    return row


async def delete_rule(db: AsyncSession, tenant_id: str, rule_id: int) -> None:
    row = await _own_rule(db, tenant_id, rule_id)
    await db.delete(row)
    await db.commit()


async def load_settings(db: AsyncSession, tenant_id: str) -> ContextSettings:
    return await context_store.load_settings(db, tenant_id)


async def save_settings(db: AsyncSession, tenant_id: str, change: SettingsChange) -> ContextSettings:
    """Replace the tenant's context settings (``InvalidSettingsError`` when out of range); the next turn uses them."""
    topic = TopicSettings(
        shift_threshold=change.shift_threshold,
        start_temperature=change.start_temperature,
        shift_temperature=change.shift_temperature,
        backend=change.similarity_backend,
    )
    settings = ContextSettings(change.history_policy, change.min_block_length, topic)
    await context_store.save_settings(db, tenant_id, settings)
    await db.commit()
    return settings


def rule_of(row: SplitterRule) -> Rule:
    return Rule(row.name, row.pattern, BlockType(row.block_type), row.priority, row.language, row.enabled)


async def own_rule(db: AsyncSession, tenant_id: str, rule_id: int) -> SplitterRule:
    """The tenant's rule ``rule_id`` (``RuleNotFoundError`` / read-only error as for an update)."""
    return await _own_rule(db, tenant_id, rule_id)


async def _own_rule(db: AsyncSession, tenant_id: str, rule_id: int) -> SplitterRule:
    """The tenant's rule ``rule_id``: a global one is read-only, another tenant's does not exist for it."""
    row = await db.get(SplitterRule, rule_id)
    if row is None or (row.tenant_id is not None and row.tenant_id != tenant_id):
        raise RuleNotFoundError(f"no rule {rule_id}")
    if row.tenant_id is None:
        raise RuleReadOnlyError(f"rule {rule_id} is global: add a rule of the same name to replace it")
    return row


async def _check_limits(
    db: AsyncSession, tenant_id: str, compiled: CompiledRule, rule_id: int | None, limits: RuleLimits
) -> None:
    """Refuse ``compiled`` (new, or replacing ``rule_id``) when the tenant's own rules would pass a cap.

    NOTE: the tenant's row is locked first (Postgres), so two admins adding rules at once cannot both take the last
    place; ``FOR NO KEY UPDATE``, which lets the audit row (a foreign key to the tenant) be written meanwhile.
    Disabled rules count too, as enabling one is an edit that must not need room.
    """
    await db.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))
    own = select(SplitterRule.id, SplitterRule.pattern).where(SplitterRule.tenant_id == tenant_id)
    rows = await db.execute(own.order_by(SplitterRule.id))
    others = [pattern for found, pattern in rows if found != rule_id]
    name = compiled.rule.name
    if rule_id is None and len(others) >= limits.max_rules:
        reason = f"the tenant has {len(others)} rules, the most it may have (KVCHAT_MAX_RULES_PER_TENANT)"
        raise RuleLimitError(name, reason)
    total = compiled.program_size + sum(await run_cpu(tenant_id, program_sizes, others))
    if total > limits.max_program_size:
        reason = (
            f"the tenant's rules would compile to {total} RE2 instructions; the limit is {limits.max_program_size} "
            "(KVCHAT_MAX_RULES_PROGRAM_SIZE)"
        )
        raise RuleLimitError(name, reason)


async def _check_name_free(db: AsyncSession, tenant_id: str, name: str, rule_id: int | None) -> None:
    found = await db.scalar(
        select(SplitterRule.id).where(SplitterRule.tenant_id == tenant_id, SplitterRule.name == name)
    )
    if found is not None and found != rule_id:
        raise RuleExistsError(f"the tenant already has a rule named {name!r} (rule {found})")
