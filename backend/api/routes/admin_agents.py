"""Admin: the tenant's human agents. Add a person (their first ``agent`` key is shown once), list them, rotate one
person's keys. An agent's key is revoked like any other (``POST /admin/tenant/keys/{key_id}/revoke``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, StateDep, audited
from backend.core.limits import SafeText
from backend.db.models import Agent
from backend.services import agents

router = APIRouter(prefix="/admin/tenant/agents", tags=["admin: agents"])


class AgentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[SafeText, Field(min_length=1, max_length=100, description="shown to the customer")]


class AgentOut(BaseModel):
    id: str
    name: str
    created_at: datetime

    @classmethod
    def of(cls, a: Agent) -> AgentOut:
        return cls(id=a.id, name=a.name, created_at=a.created_at)


class AgentKeyOut(BaseModel):
    agent: AgentOut
    key_id: str
    prefix: str
    key: str = Field(description="the agent's key: shown this once, only its hash is kept")


@router.get("", response_model=list[AgentOut])
async def list_agents(tenant: AdminDep, db: DbDep) -> list[AgentOut]:
    return [AgentOut.of(a) for a in await agents.list_agents(db, tenant.id)]


@router.post(
    "",
    response_model=AgentKeyOut,
    status_code=201,
    dependencies=[audited("agent.create")],
    responses={409: {"description": "agent_exists: the tenant has an agent of that name"}},
)
async def create_agent(body: AgentIn, tenant: AdminDep, db: DbDep) -> AgentKeyOut:
    """Add a person who answers hand-offs, with their first ``agent`` key (shown once)."""
    issued = await agents.add_agent(db, tenant.id, body.name)
    key = issued.key
    return AgentKeyOut(agent=AgentOut.of(issued.agent), key_id=key.id, prefix=key.prefix, key=key.key)


@router.post("/{agent_id}/rotate", response_model=AgentKeyOut, dependencies=[audited("agent.rotate")])
async def rotate_agent_key(
    agent_id: Annotated[SafeText, Path(max_length=36)], tenant: AdminDep, db: DbDep, state: StateDep
) -> AgentKeyOut:
    """Revoke the agent's live keys (their sockets are closed, 4401 "key revoked") and issue a new one, shown once."""
    issued = await agents.rotate_agent_key_now(db, tenant.id, agent_id, state.chat.hub.keys)
    key = issued.key
    return AgentKeyOut(agent=AgentOut.of(issued.agent), key_id=key.id, prefix=key.prefix, key=key.key)
