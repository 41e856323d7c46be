"""Agents: the people of a tenant who answer hand-offs, each with their own ``agent`` keys.

An agent key authenticates its person for the inbox (``backend/services/inbox.py``) and the agent feed; it opens no
admin route (those take ``admin`` keys only). An admin key is accepted wherever an agent's is: it acts as the tenant's
support team (``Actor`` with no agent). Rotating an agent's key revokes only that agent's live keys; revoking closes
the sockets the key opened, as for chat keys (``backend/services/revocation.py``).
"""

from __future__ import annotations

import dataclasses
import hmac
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.security import hash_key
from backend.db.models import Agent, ApiKey, Tenant, utcnow
from backend.domain import KeyKind
from backend.services.inbox_errors import AgentExistsError, AgentNotFoundError
from backend.services.revocation import KeyWatch, announce_revoked
from backend.services.tenants import IssuedKey, issue_key

ADMIN_NAME = "Support"  # the name the customer sees for a reply written with an admin key


@dataclass(frozen=True, slots=True)
class Actor:
    """Who acts in the inbox: an agent (``agent_id``), or an admin key acting as the support team."""

    tenant: Tenant
    key_id: str
    agent_id: str | None
    name: str

    @property
    def ref(self) -> str:
        """The holder id a claim stores: the agent's id, or ``admin:<key id>``."""
        return self.agent_id if self.agent_id is not None else f"admin:{self.key_id}"

    @property
    def is_admin(self) -> bool:
        return self.agent_id is None


@dataclass(frozen=True, slots=True)
class IssuedAgent:
    agent: Agent
    key: IssuedKey


async def create_agent(db: AsyncSession, tenant_id: str, name: str) -> IssuedAgent:
    """Add a person and issue their first key (flushed; the caller commits)."""
    if await _by_name(db, tenant_id, name) is not None:
        raise AgentExistsError(f"an agent named {name!r} already exists")
    agent = Agent(tenant_id=tenant_id, name=name)
    db.add(agent)
    try:
        await db.flush()
    except IntegrityError as exc:  # a concurrent create won the race for the name
        raise AgentExistsError(f"an agent named {name!r} already exists") from exc
    return IssuedAgent(agent, await issue_key(db, tenant_id, KeyKind.AGENT, agent_id=agent.id))


async def get_agent(db: AsyncSession, tenant_id: str, id_or_name: str) -> Agent:
    """The tenant's agent by id or by name."""
    row = await db.execute(
        select(Agent).where(Agent.tenant_id == tenant_id, (Agent.id == id_or_name) | (Agent.name == id_or_name))
    )
    agent = row.scalars().first()
    if agent is None:
        raise AgentNotFoundError(f"no agent {id_or_name!r}")
    return agent


async def list_agents(db: AsyncSession, tenant_id: str) -> list[Agent]:
    rows = await db.execute(select(Agent).where(Agent.tenant_id == tenant_id).order_by(Agent.name))
    return list(rows.scalars())


async def rotate_agent_key(db: AsyncSession, tenant_id: str, agent_id: str) -> IssuedKey:
    """Revoke the agent's live keys and issue one new key, in the caller's transaction."""
    agent = await get_agent(db, tenant_id, agent_id)
    revoked = await db.execute(
        update(ApiKey)
        .where(ApiKey.agent_id == agent.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .returning(ApiKey.id)
    )
    ids = tuple(revoked.scalars())
    await announce_revoked(db, ids)
    issued = await issue_key(db, tenant_id, KeyKind.AGENT, agent_id=agent.id)
    return dataclasses.replace(issued, revoked=ids)


async def authenticate_actor(db: AsyncSession, key: str) -> Actor | None:
    """The person (an ``agent`` key) or support team (an ``admin`` key) ``key`` authenticates, or None."""
    if not key:
        return None
    digest = hash_key(key)
    row = await db.execute(
        select(Tenant, ApiKey.key_hash, ApiKey.id, ApiKey.kind, Agent.id, Agent.name)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .outerjoin(Agent, Agent.id == ApiKey.agent_id)
        .where(
            ApiKey.key_hash == digest,
            ApiKey.kind.in_((KeyKind.AGENT.value, KeyKind.ADMIN.value)),
            ApiKey.revoked_at.is_(None),
        )
    )
    found = row.first()
    # NOTE: compared again in constant time, as ``tenants.authenticate_key`` does
    if found is None or not hmac.compare_digest(found[1], digest):
        return None
    tenant, _, key_id, kind, agent_id, name = found
    if kind == KeyKind.AGENT.value:
        if agent_id is None:  # (an agent key whose person is gone: the cascade deletes it; never admit it)
            return None
        return Actor(tenant, key_id, agent_id, name)
    return Actor(tenant, key_id, None, ADMIN_NAME)


async def add_agent(db: AsyncSession, tenant_id: str, name: str) -> IssuedAgent:
    """``create_agent``, committed (the admin API)."""
    issued = await create_agent(db, tenant_id, name)
    await db.commit()
    return issued


async def rotate_agent_key_now(db: AsyncSession, tenant_id: str, agent_id: str, watch: KeyWatch) -> IssuedAgent:
    """``rotate_agent_key``, committed; the sockets the old keys opened are closed (this process's at once, the
    others' when the commit's notification reaches them)."""
    agent = await get_agent(db, tenant_id, agent_id)
    issued = await rotate_agent_key(db, tenant_id, agent.id)
    await db.commit()
    watch.revoked(issued.revoked)
    return IssuedAgent(agent, issued)


async def names_of(db: AsyncSession, agent_ids: set[str]) -> dict[str, str]:
    """Agents' names by id (the ones still there)."""
    if not agent_ids:
        return {}
    rows = await db.execute(select(Agent.id, Agent.name).where(Agent.id.in_(sorted(agent_ids))))
    return {agent_id: name for agent_id, name in rows}


async def _by_name(db: AsyncSession, tenant_id: str, name: str) -> Agent | None:
    row = await db.execute(select(Agent).where(Agent.tenant_id == tenant_id, Agent.name == name))
    return row.scalar_one_or_none()
