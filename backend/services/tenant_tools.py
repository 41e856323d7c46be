"""A tenant's tools: the HTTP endpoints the bot may call during a turn (name, what it does, the JSON schema of its
arguments, the URL, a secret header sent with every call, a timeout). Names are unique within the tenant; the secret
is write-only (the admin API shows whether one is set, never its value)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import InvalidToolError, ToolExistsError, ToolNotFoundError
from backend.db.models import TenantTool
from backend.services.tool_policy import refused_address
from backend.tools.types import ToolError, ToolSpec

MAX_TOOLS_PER_TENANT = 32
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$")  # an HTTP header name (RFC 9110 token)
_FORBIDDEN_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


@dataclass(frozen=True, slots=True)
class ToolEndpoint:
    """A registered tool as a turn uses it (a snapshot: no ORM row outlives its database session)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    url: str
    secret_header: str | None
    secret_value: str | None
    timeout_s: float

    @classmethod
    def of(cls, row: TenantTool) -> ToolEndpoint:
        return cls(
            row.name,
            row.description,
            json.loads(row.parameters),
            row.url,
            row.secret_header,
            row.secret_value,
            row.timeout_s,
        )

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


@dataclass(frozen=True, slots=True)
class ToolChange:
    """A tool as the admin API writes it; ``secret`` None keeps the stored secret (it is never read back)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    url: str
    secret_header: str | None = None
    secret: str | None = None
    timeout_s: float = 5.0
    enabled: bool = True

    def checked(self) -> ToolChange:
        """This change, or ``InvalidToolError`` naming the field that cannot be used."""
        try:
            ToolSpec(self.name, self.description, self.parameters)
        except ToolError as exc:
            raise InvalidToolError(str(exc)) from None
        url = urlsplit(self.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise InvalidToolError(f"url must be an http:// or https:// URL with a host, got {self.url!r}")
        if self.secret_header is not None and (
            not _HEADER.match(self.secret_header) or self.secret_header.lower() in _FORBIDDEN_HEADERS
        ):
            raise InvalidToolError(f"secret_header {self.secret_header!r} cannot be used as a header name")
        if self.secret is not None and self.secret_header is None:
            raise InvalidToolError("a secret needs a secret_header to be sent in")
        return self


async def list_tools(db: AsyncSession, tenant_id: str) -> list[TenantTool]:
    rows = await db.execute(select(TenantTool).where(TenantTool.tenant_id == tenant_id).order_by(TenantTool.name))
    return list(rows.scalars())


async def get_tool(db: AsyncSession, tenant_id: str, name: str) -> TenantTool:
    row = await db.scalar(select(TenantTool).where(TenantTool.tenant_id == tenant_id, TenantTool.name == name))
    if row is None:
        raise ToolNotFoundError(f"no tool named {name!r}")
    return row


async def check_address(change: ToolChange, allow_private_networks: bool) -> None:
    """Refuse at registration a URL every call would be refused for (``tool_policy``), with the reason."""
    refused = await refused_address(change.url, allow_private_networks)
    if refused is not None:
        raise InvalidToolError(
            f"url {change.url!r} is refused: {refused}; tools may not call the server's own network "
            "(the operator allows it with KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS)"
        )


async def create_tool(
    db: AsyncSession, tenant_id: str, change: ToolChange, allow_private_networks: bool = False
) -> TenantTool:
    change.checked()
    await check_address(change, allow_private_networks)
    count = await db.scalar(select(func.count()).select_from(TenantTool).where(TenantTool.tenant_id == tenant_id))
    if (count or 0) >= MAX_TOOLS_PER_TENANT:
        raise InvalidToolError(f"a tenant may register at most {MAX_TOOLS_PER_TENANT} tools")
    exists = await db.scalar(
        select(TenantTool.id).where(TenantTool.tenant_id == tenant_id, TenantTool.name == change.name)
    )
    if exists is not None:
        raise ToolExistsError(f"a tool named {change.name!r} exists already")
    row = TenantTool(tenant_id=tenant_id, secret_value=change.secret)
    _apply(row, change)
    db.add(row)
    await db.commit()
    return row


async def replace_tool(
    db: AsyncSession, tenant_id: str, name: str, change: ToolChange, allow_private_networks: bool = False
) -> TenantTool:
    """Replace a tool (it may be renamed); the stored secret stays unless ``change.secret`` gives a new one."""
    change.checked()
    await check_address(change, allow_private_networks)
    row = await get_tool(db, tenant_id, name)
    if change.name != name:
        taken = await db.scalar(
            select(TenantTool.id).where(TenantTool.tenant_id == tenant_id, TenantTool.name == change.name)
        )
        if taken is not None:
            raise ToolExistsError(f"a tool named {change.name!r} exists already")
    _apply(row, change)
    if change.secret is not None:
        row.secret_value = change.secret
    if change.secret_header is None:
        row.secret_value = None
    await db.commit()
    return row


async def delete_tool(db: AsyncSession, tenant_id: str, name: str) -> None:
    await db.delete(await get_tool(db, tenant_id, name))
    await db.commit()


def _apply(row: TenantTool, change: ToolChange) -> None:
    row.name = change.name
    row.description = change.description
    row.parameters = json.dumps(dict(change.parameters))
    row.url = change.url
    row.secret_header = change.secret_header
    row.timeout_s = change.timeout_s
    row.enabled = change.enabled
