"""Calling a tenant's tool during a turn: one HTTP request, bounded in time and size, and one audit row per call.

The contract with the tenant's endpoint: ``POST <url>`` with the call's arguments as a JSON object, the tenant's
secret header, ``X-Kvchat-Tool`` (the tool's name) and ``X-Kvchat-Session``; it answers 2xx with JSON (at most
64 KiB) within the tool's timeout. Anything else is a failed call (``CallOutcome`` says how); the bot then answers
gracefully rather than making up data. Every call, failed or not, leaves an ``admin_audit`` row (actor ``bot``,
action ``tool.call``, target the tool's name, result the outcome, detail the session, HTTP status and time).

Endpoints on loopback, private or link-local addresses are refused unless the operator allows them
(``backend/services/tool_policy.py``; checked at registration and again at each call). A call the model writes that
does not parse, or that is past the turn's limits, is audited too (``UNPARSED``, ``OVER_LIMIT``), though none is made.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.services import audit
from backend.services.tenant_tools import ToolEndpoint, get_tool
from backend.services.tool_policy import refused_address
from backend.tools.types import ToolCall

MAX_RESPONSE_BYTES = 64 * 1024
BOT_ACTOR = "bot"
ACTION = "tool.call"
UNPARSED_TARGET = "(unparsed)"  # the audit row's target when the model's call names no tool that could be read


class CallOutcome(enum.StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"  # no answer within the tool's timeout
    HTTP_ERROR = "http_error"  # a status other than 2xx
    BAD_RESPONSE = "bad_response"  # not JSON, or over MAX_RESPONSE_BYTES
    UNREACHABLE = "unreachable"  # the connection failed
    REFUSED_ADDRESS = "refused_address"  # a private address the operator did not allow
    UNKNOWN_TOOL = "unknown_tool"  # the model named a tool the tenant does not have
    BAD_ARGUMENTS = "bad_arguments"  # the arguments are not a JSON object
    UNPARSED = "unparsed"  # the model began a call that does not parse (no call is made)
    OVER_LIMIT = "over_limit"  # past the calls a turn may make (no call is made)


@dataclass(frozen=True, slots=True)
class ToolResult:
    call: ToolCall
    outcome: CallOutcome
    content: str  # what the model reads: the endpoint's JSON (with OK), else ""
    detail: str  # for the audit row and the log
    elapsed_ms: float

    @property
    def ok(self) -> bool:
        return self.outcome is CallOutcome.OK


class ToolCaller:
    """Makes tool calls for the chat service and audits each one."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        allow_private_networks: bool = False,
        actor: str = BOT_ACTOR,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._allow_private = allow_private_networks
        self._actor = actor  # BOT_ACTOR in a turn; an admin key's prefix for the settings page's "test this tool"

    async def call(
        self, tenant_id: str, session_id: str, tools: Mapping[str, ToolEndpoint], call: ToolCall
    ) -> ToolResult:
        started = time.monotonic()
        outcome, content, detail = await self._call(session_id, tools.get(call.name), call)
        elapsed_ms = (time.monotonic() - started) * 1000
        detail = f"session {session_id}: {detail} in {elapsed_ms:.0f} ms"
        result = ToolResult(call, outcome, content, detail, elapsed_ms)
        await self._audit(tenant_id, call.name, outcome, result.detail)
        return result

    async def not_made(self, tenant_id: str, session_id: str, target: str, outcome: CallOutcome, detail: str) -> None:
        """Audit a call the model attempted that is not made: one that does not parse, or one past the limits."""
        await self._audit(tenant_id, target, outcome, f"session {session_id}: {detail}")

    async def _audit(self, tenant_id: str, target: str, outcome: CallOutcome, detail: str) -> None:
        entry = audit.AuditEntry(tenant_id, self._actor, ACTION, target[:200], outcome.value, detail[:500])
        await audit.record(self._sessionmaker, entry)

    async def _call(self, session_id: str, tool: ToolEndpoint | None, call: ToolCall) -> tuple[CallOutcome, str, str]:
        if tool is None:
            return CallOutcome.UNKNOWN_TOOL, "", f"the tenant has no tool {call.name!r}"
        try:
            arguments = call.parsed_arguments
        except ValueError as exc:
            return CallOutcome.BAD_ARGUMENTS, "", f"arguments are not a JSON object ({exc})"
        refused = await refused_address(tool.url, self._allow_private)
        if refused is not None:
            return CallOutcome.REFUSED_ADDRESS, "", f"refused: {refused}"
        headers = {"X-Kvchat-Tool": tool.name, "X-Kvchat-Session": session_id}
        if tool.secret_header and tool.secret_value is not None:
            headers[tool.secret_header] = tool.secret_value
        try:
            async with (
                httpx.AsyncClient(timeout=tool.timeout_s, follow_redirects=False) as http,
                asyncio.timeout(tool.timeout_s),
            ):
                response = await http.post(tool.url, json=arguments, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            return CallOutcome.TIMEOUT, "", f"no answer within {tool.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return CallOutcome.UNREACHABLE, "", f"{type(exc).__name__}: {exc}"
        if not 200 <= response.status_code < 300:
            return CallOutcome.HTTP_ERROR, "", f"HTTP {response.status_code}"
        if len(response.content) > MAX_RESPONSE_BYTES:
            return CallOutcome.BAD_RESPONSE, "", f"HTTP {response.status_code}, {len(response.content)} bytes"
        try:
            value = json.loads(response.content)
        except ValueError:
            return CallOutcome.BAD_RESPONSE, "", f"HTTP {response.status_code}, not JSON"
        return CallOutcome.OK, json.dumps(value, ensure_ascii=False), f"HTTP {response.status_code}"


TEST_SESSION = "admin-test"  # the X-Kvchat-Session of a call made from the settings page's "test this tool"


async def try_tool(
    sessionmaker: async_sessionmaker[AsyncSession],
    tenant_id: str,
    name: str,
    arguments: Mapping[str, object],
    allow_private_networks: bool,
    actor: str,
) -> ToolResult:
    """One call of the tenant's tool ``name`` with ``arguments``, as a turn would make it (same policy, timeout and
    checks), audited under ``actor``: the settings page's "test this tool" button. ``ToolNotFoundError`` when the
    tenant has no such tool."""
    async with sessionmaker() as db:
        tool = ToolEndpoint.of(await get_tool(db, tenant_id, name))
    caller = ToolCaller(sessionmaker, allow_private_networks, actor)
    call = ToolCall(tool.name, json.dumps(dict(arguments)))
    return await caller.call(tenant_id, TEST_SESSION, {tool.name: tool}, call)
