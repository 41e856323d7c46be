"""Calling a tenant's tool during a turn: one HTTP request, bounded in time and size, and one audit row per call.

The contract with the tenant's endpoint: ``POST <url>`` with the call's arguments as a JSON object, the tenant's
secret header, ``X-Kvchat-Tool`` (the tool's name) and ``X-Kvchat-Session``; it answers 2xx with JSON (at most
64 KiB) within the tool's timeout. Anything else is a failed call (``CallOutcome`` says how); the bot then answers
gracefully rather than making up data. Every call, failed or not, leaves an ``admin_audit`` row (actor ``bot``,
action ``tool.call``, target the tool's name, result the outcome, detail the session, HTTP status and time).

Endpoints on loopback, private or link-local addresses are refused unless the operator allows them
(``KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS``): a tenant must not reach the server's own network through the bot.
NOTE: the address is checked when the call is made (the host resolved then); a host that resolves differently
between the check and the connection (DNS rebinding) is not caught here: put an egress proxy in front if tenants
are not trusted with that.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import json
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.services import audit
from backend.services.tenant_tools import ToolEndpoint
from backend.tools.types import ToolCall

MAX_RESPONSE_BYTES = 64 * 1024
BOT_ACTOR = "bot"
ACTION = "tool.call"


class CallOutcome(enum.StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"  # no answer within the tool's timeout
    HTTP_ERROR = "http_error"  # a status other than 2xx
    BAD_RESPONSE = "bad_response"  # not JSON, or over MAX_RESPONSE_BYTES
    UNREACHABLE = "unreachable"  # the connection failed
    REFUSED_ADDRESS = "refused_address"  # a private address the operator did not allow
    UNKNOWN_TOOL = "unknown_tool"  # the model named a tool the tenant does not have
    BAD_ARGUMENTS = "bad_arguments"  # the arguments are not a JSON object


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

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], allow_private_networks: bool = False) -> None:
        self._sessionmaker = sessionmaker
        self._allow_private = allow_private_networks

    async def call(
        self, tenant_id: str, session_id: str, tools: Mapping[str, ToolEndpoint], call: ToolCall
    ) -> ToolResult:
        started = time.monotonic()
        outcome, content, detail = await self._call(session_id, tools.get(call.name), call)
        elapsed_ms = (time.monotonic() - started) * 1000
        detail = f"session {session_id}: {detail} in {elapsed_ms:.0f} ms"
        result = ToolResult(call, outcome, content, detail, elapsed_ms)
        entry = audit.AuditEntry(tenant_id, BOT_ACTOR, ACTION, call.name[:200], outcome.value, result.detail[:500])
        await audit.record(self._sessionmaker, entry)
        return result

    async def _call(self, session_id: str, tool: ToolEndpoint | None, call: ToolCall) -> tuple[CallOutcome, str, str]:
        if tool is None:
            return CallOutcome.UNKNOWN_TOOL, "", f"the tenant has no tool {call.name!r}"
        try:
            arguments = call.parsed_arguments
        except ValueError as exc:
            return CallOutcome.BAD_ARGUMENTS, "", f"arguments are not a JSON object ({exc})"
        if not self._allow_private and await _private_address(tool.url):
            return CallOutcome.REFUSED_ADDRESS, "", "the URL resolves to a private address"
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


async def _private_address(url: str) -> bool:
    """Whether the URL's host is, or resolves to, a loopback, private, link-local or otherwise non-public address."""
    host = urlsplit(url).hostname or ""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # NOTE: the call then fails as unreachable, with the resolver's reason
    return any(not ipaddress.ip_address(info[4][0]).is_global for info in infos)
