"""Errors raised by the backend's services, mapped once at each boundary (websocket frames, HTTP statuses).

    BackendError                   code               HTTP   websocket
    ├── SessionNotFoundError       session_not_found  404    close 4404 (on hello) / error frame
    ├── SessionClosedError         session_closed     409    error frame
    ├── MessageTooLongError        message_too_long   413    error frame (before the ack: nothing is stored)
    ├── ShuttingDownError          shutting_down      503    error frame (the server is draining; retry later)
    ├── StartingError              starting           503    error frame, then close 1013 (not ready yet; Retry-After)
    ├── TenantNotFoundError        tenant_not_found   404    —
    ├── TenantExistsError          tenant_exists      409    —
    ├── KeyNotFoundError           key_not_found      404    —
    ├── KeyRevokedError            key_revoked        409    —  (``kvchat keys revoke`` of a key revoked already)
    ├── RuleNotFoundError          rule_not_found     404    —
    ├── RuleReadOnlyError          rule_read_only     403    —  (a global rule: shadow it by name instead)
    ├── RuleExistsError            rule_exists        409    —
    ├── InvalidCacheSettingsError  invalid_cache_settings 422 —  (the engine or the tenant's scope refused a value)
    ├── PinRefusedError            pin_refused        409    —  (the prefix is over the operator's pinned share)
    ├── NamespaceSharedError       namespace_shared   409    —  (a whole-namespace action on the public namespace)
    ├── InvalidReplySettingsError  invalid_reply_settings 422 —  (a sampling value the engine refuses)
    ├── ToolNotFoundError          tool_not_found     404    —
    ├── ToolExistsError            tool_exists        409    —
    └── InvalidToolError           invalid_tool       422    —  (a tool's schema, URL or header cannot be used)

Context-layer errors (``backend.context.errors``: ``invalid_rule``, ``invalid_settings``, ``unknown_backend``: 422;
``backend_unavailable``: 503) are mapped by the HTTP boundary too, with their own codes.

Authentication failures are answered at the boundary itself (401 / close 4401). Engine errors (``engine.errors``)
are mapped by ``engine_error_code`` below: busy → ``busy`` (websocket error frame with ``retry_after_ms``; HTTP 503 +
Retry-After), a tenant over its quota (``backend/core/tenant_quota.RateLimited``) → ``rate_limited`` (the same frame;
HTTP 429 + Retry-After), prompt too long → ``prompt_too_long``, invalid params → ``invalid_request``, engine stopped →
``unavailable``. The OpenAI-compatible API maps them to OpenAI's error shape in ``backend/openai/errors.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from backend.core.tenant_quota import RateLimited
from backend.engine_client.values import EngineBusy, EngineError, EngineStopped, InvalidRequestError, PromptTooLongError

# The stable ``code`` of an HTTP error that carries none of its own (both error shapes use it).
HTTP_STATUS_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "invalid_request",
}


class BackendError(Exception):
    code = "internal_error"
    status = 500


class SessionNotFoundError(BackendError):
    code = "session_not_found"
    status = 404


class SessionClosedError(BackendError):
    code = "session_closed"
    status = 409


class MessageTooLongError(BackendError):
    """The message could never be answered: with the system prompt and a reply it exceeds the model's budget."""

    code = "message_too_long"
    status = 413

    def __init__(self, tokens: int, limit: int, *, at_least: bool = False) -> None:
        self.tokens = tokens
        self.limit = limit
        count = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(f"message too long: {count} tokens with the system prompt; the limit is {limit} tokens")


class ShuttingDownError(BackendError):
    code = "shutting_down"
    status = 503


class StartingError(BackendError):
    """The server listens but its start is not done (``backend.core.startup``): retry in a few seconds."""

    code = "starting"
    status = 503
    retry_after_s = 5

    def __init__(self, phase: str) -> None:
        self.phase = phase
        if phase == "failed":  # (kvchat serve exits then; an app embedded elsewhere keeps answering this)
            super().__init__("kvchat could not start; the server's log says why")
        else:
            super().__init__(f"kvchat is starting ({phase}); retry in a few seconds")


class TenantNotFoundError(BackendError):
    code = "tenant_not_found"
    status = 404


class TenantExistsError(BackendError):
    code = "tenant_exists"
    status = 409


class KeyNotFoundError(BackendError):
    code = "key_not_found"
    status = 404


class KeyRevokedError(BackendError):
    code = "key_revoked"
    status = 409


class RuleNotFoundError(BackendError):
    code = "rule_not_found"
    status = 404


class RuleReadOnlyError(BackendError):
    code = "rule_read_only"
    status = 403


class RuleExistsError(BackendError):
    code = "rule_exists"
    status = 409


class InvalidCacheSettingsError(BackendError):
    code = "invalid_cache_settings"
    status = 422


class PinRefusedError(BackendError):
    code = "pin_refused"
    status = 409


class NamespaceSharedError(BackendError):
    code = "namespace_shared"
    status = 409


class InvalidReplySettingsError(BackendError):
    code = "invalid_reply_settings"
    status = 422


class ToolNotFoundError(BackendError):
    code = "tool_not_found"
    status = 404


class ToolExistsError(BackendError):
    code = "tool_exists"
    status = 409


class InvalidToolError(BackendError):
    code = "invalid_tool"
    status = 422


def engine_error_code(exc: EngineError) -> str:
    if isinstance(exc, RateLimited):
        return "rate_limited"
    if isinstance(exc, EngineBusy):
        return "busy"
    if isinstance(exc, PromptTooLongError):
        return "prompt_too_long"
    if isinstance(exc, InvalidRequestError):
        return "invalid_request"
    if isinstance(exc, EngineStopped):
        return "unavailable"
    return "engine_error"


def one_line_reason(exc: BaseException) -> str:
    """The error's own message on one line (for a driver error, the driver's, which SQLAlchemy wraps)."""
    inner = getattr(exc, "orig", None) or exc
    return " ".join(str(inner).split()) or type(inner).__name__


def error_location(loc: Iterable[object]) -> str:
    """A pydantic error location as a client reads it: ``messages.0.content``.

    NOTE: pydantic names the member of a union it tried (``str``, ``function-after[...]``, ``list[...]``); those
    tags mean nothing to a client, and neither does ``body``, so they are dropped.
    """
    parts = [str(p) for p in loc]
    return ".".join(p for p in parts if p != "body" and "[" not in p and p not in _UNION_TAGS)


def error_problem(detail: Mapping[str, Any]) -> str:
    """A pydantic error's message without pydantic's ``"Value error, "`` prefix (our validators' own words)."""
    return str(detail.get("msg", "invalid value")).removeprefix("Value error, ")


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "constrained-str"})
