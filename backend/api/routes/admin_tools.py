"""Admin: the tenant's tools — HTTP endpoints the bot may call during a turn (``backend/services/tool_calls.py``
says what an endpoint receives and must answer). The secret is write-only: it is sent with every call and never
shown again (``has_secret`` says whether one is set). Every call the bot makes is in the audit trail (action
``tool.call``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminActorDep, AdminDep, DbDep, SettingsDep, StateDep, audited
from backend.api.partial import merged, partial_model
from backend.core.limits import SafeText
from backend.db.models import TenantTool
from backend.services import tenant_tools, tool_calls
from backend.services.tenant_tools import ToolChange, ToolEndpoint

router = APIRouter(prefix="/admin/tools", tags=["admin: tools"])
ToolName = Annotated[SafeText, Path(min_length=1, max_length=64, description="the tool's name")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no tool of that name (tool_not_found)"}}
NAME_TAKEN: dict[int | str, dict[str, Any]] = {409: {"description": "a tool of that name exists (tool_exists)"}}


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[SafeText, Field(min_length=1, max_length=64)] = Field(
        description="letters, digits, '_' or '-': what the model calls"
    )
    description: Annotated[SafeText, Field(max_length=2000)] = Field(
        default="", description="what it does, for the model"
    )
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="the JSON schema of the arguments (an object)",
    )
    url: Annotated[SafeText, Field(min_length=1, max_length=2000)] = Field(description="POSTed the arguments as JSON")
    secret_header: Annotated[SafeText, Field(max_length=100)] | None = Field(
        default=None, description="the header the secret is sent in (None: no secret)"
    )
    secret: Annotated[SafeText, Field(max_length=1000)] | None = Field(
        default=None, description="write-only; on PUT, left out keeps the stored one"
    )
    timeout_s: float = Field(default=5.0, ge=0.1, le=30.0, description="a call without an answer by then fails")
    enabled: bool = True

    def change(self) -> ToolChange:
        return ToolChange(
            self.name,
            self.description,
            self.parameters,
            self.url,
            self.secret_header,
            self.secret,
            self.timeout_s,
            self.enabled,
        )


class ToolOut(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]
    url: str
    secret_header: str | None
    has_secret: bool
    timeout_s: float
    enabled: bool
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, row: TenantTool) -> ToolOut:
        endpoint = ToolEndpoint.of(row)
        return cls(
            name=row.name,
            description=row.description,
            parameters=dict(endpoint.parameters),
            url=row.url,
            secret_header=row.secret_header,
            has_secret=row.secret_value is not None,
            timeout_s=row.timeout_s,
            enabled=row.enabled,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )


@router.get("", response_model=list[ToolOut])
async def list_tools(tenant: AdminDep, db: DbDep) -> list[ToolOut]:
    return [ToolOut.of(t) for t in await tenant_tools.list_tools(db, tenant.id)]


@router.post(
    "",
    response_model=ToolOut,
    status_code=status.HTTP_201_CREATED,
    responses=NAME_TAKEN,
    dependencies=[audited("tool.create")],
)
async def create_tool(body: ToolIn, tenant: AdminDep, db: DbDep, settings: SettingsDep) -> ToolOut:
    """Register a tool; the bot offers it from the next turn (when the tenant's ``tool_use`` is not ``none``). A URL
    the tool policy refuses (the server's own network) is a 422 ``invalid_tool`` with the reason."""
    allow = settings.tools_allow_private_networks
    return ToolOut.of(await tenant_tools.create_tool(db, tenant.id, body.change(), allow))


class ToolTestIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arguments: dict[str, Any] = Field(default_factory=dict, description="the call's arguments (a JSON object)")


class ToolTestOut(BaseModel):
    outcome: str = Field(description="ok, timeout, http_error, bad_response, unreachable, refused_address, ...")
    content: str = Field(description="what the model would read: the endpoint's JSON (with ok), else empty")
    detail: str = Field(description="what happened, as the audit row has it")
    elapsed_ms: float


@router.post("/{name}/test", response_model=ToolTestOut, responses=NOT_FOUND)
async def test_tool(
    name: ToolName,
    body: ToolTestIn,
    tenant: AdminDep,
    state: StateDep,
    actor: AdminActorDep,
) -> ToolTestOut:
    """Make one call of the tool now, as the bot would (same URL policy, secret and timeout), and show the answer.
    Audited as ``tool.call`` under the admin key's prefix."""
    allow = state.settings.tools_allow_private_networks
    result = await tool_calls.try_tool(state.sessionmaker, tenant.id, name, body.arguments, allow, actor)
    return ToolTestOut(
        outcome=result.outcome.value, content=result.content, detail=result.detail, elapsed_ms=result.elapsed_ms
    )


@router.get("/{name}", response_model=ToolOut, responses=NOT_FOUND)
async def get_tool(name: ToolName, tenant: AdminDep, db: DbDep) -> ToolOut:
    return ToolOut.of(await tenant_tools.get_tool(db, tenant.id, name))


@router.put("/{name}", response_model=ToolOut, responses=NOT_FOUND | NAME_TAKEN, dependencies=[audited("tool.replace")])
async def replace_tool(name: ToolName, body: ToolIn, tenant: AdminDep, db: DbDep, settings: SettingsDep) -> ToolOut:
    """Replace a tool (it may be renamed); the stored secret stays unless a new one is sent."""
    allow = settings.tools_allow_private_networks
    return ToolOut.of(await tenant_tools.replace_tool(db, tenant.id, name, body.change(), allow))


ToolPatch = partial_model(ToolIn)


@router.patch(
    "/{name}", response_model=ToolOut, responses=NOT_FOUND | NAME_TAKEN, dependencies=[audited("tool.replace")]
)
async def patch_tool(
    name: ToolName,
    body: ToolPatch,  # type: ignore[valid-type]
    tenant: AdminDep,
    db: DbDep,
    settings: SettingsDep,
) -> ToolOut:
    """Change the fields given (e.g. ``{"enabled": false}``); the others, and the stored secret, keep their value."""
    current = await get_tool(name, tenant, db)
    return await replace_tool(name, merged(current, body, ToolIn), tenant, db, settings)


@router.delete(
    "/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND, dependencies=[audited("tool.delete")]
)
async def delete_tool(name: ToolName, tenant: AdminDep, db: DbDep) -> Response:
    await tenant_tools.delete_tool(db, tenant.id, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
