"""Shared FastAPI dependencies, as ``Annotated`` aliases (one place, imported by every router)."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.exceptions import RequestValidationError
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.api.state import AppState
from backend.core.config import Settings
from backend.core.errors import HTTP_STATUS_CODES, StartingError
from backend.core.security import display_prefix
from backend.db.models import Tenant
from backend.domain import KeyKind
from backend.services import audit
from backend.services.agents import Actor, authenticate_actor
from backend.services.tenants import authenticate


def get_state(request: Request) -> AppState:
    """What the lifespan built; until the start is done (``kvchat serve`` listens meanwhile) a 503 ``starting``."""
    state: AppState | None = getattr(request.app.state, "kvchat", None)
    if state is None:
        raise StartingError(request.app.state.startup.phase)
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_settings(state: StateDep) -> Settings:
    return state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_db(state: StateDep) -> AsyncIterator[AsyncSession]:
    # NOTE: one short session per request; websocket handlers open their own per message instead.
    async with state.sessionmaker() as session:
        yield session


DbDep = Annotated[AsyncSession, Depends(get_db)]


# NOTE: declared so the OpenAPI schema (and /docs' "Authorize" button) knows how to send keys; reading them stays
# in bearer_token(), which accepts either header for any route.
ADMIN_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False, description="a tenant's admin API key")
BEARER = HTTPBearer(auto_error=False, description="a tenant's chat token (the OpenAI API key) or admin key")


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


async def get_admin_tenant(
    request: Request,
    db: DbDep,
    _key: Annotated[str | None, Security(ADMIN_KEY_HEADER)] = None,
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None,
) -> Tenant:
    """The tenant whose *admin* key authorizes this request (``Authorization: Bearer`` or ``X-API-Key``)."""
    tenant = await authenticate(db, bearer_token(request), KeyKind.ADMIN)
    if tenant is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "a valid admin API key is required", headers={"WWW-Authenticate": "Bearer"}
        )
    return tenant


AdminDep = Annotated[Tenant, Depends(get_admin_tenant)]


async def get_actor(
    request: Request,
    db: DbDep,
    _key: Annotated[str | None, Security(ADMIN_KEY_HEADER)] = None,
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None,
) -> Actor:
    """The person (an ``agent`` key) or support team (an ``admin`` key) acting in the inbox."""
    actor = await authenticate_actor(db, bearer_token(request))
    if actor is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid agent or admin API key is required",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return actor


ActorDep = Annotated[Actor, Depends(get_actor)]


def get_admin_actor(request: Request, tenant: AdminDep) -> str:
    """Who the admin is in the audit trail: the admin key's display prefix (as ``audited`` records it)."""
    return display_prefix(bearer_token(request))


AdminActorDep = Annotated[str, Depends(get_admin_actor)]


def audited(action: str) -> Any:
    """A route dependency that writes one ``admin_audit`` row for the request: ``action``, the path's ids as the
    target, the admin key's prefix as the actor, and ``ok`` or the error's code. Requests refused before a tenant is
    known (401) are not audited: there is no tenant to file them under.

    NOTE: function scope, so the row is written before the response is sent (a client reading the audit right after
    its write sees it) and the route's exception, not yet mapped to a response, reaches it.
    """

    async def record(request: Request, tenant: AdminDep, state: StateDep) -> AsyncIterator[None]:
        entry = audit.AuditEntry(tenant.id, display_prefix(bearer_token(request)), action, _target(request), audit.OK)
        async with _recording(request, state, entry):
            yield

    dependency: Callable[..., Any] = record
    return Depends(dependency, scope="function")


def audit_note(request: Request, detail: str, result: str = audit.OK) -> None:
    """What the action did, for its audit row (``audited`` / ``operator_audited`` store it with the result);
    ``result`` ``audit.INCOMPLETE`` for an action done in part (an error still records the error's code)."""
    request.state.audit_detail = detail[:500]
    request.state.audit_result = result


@asynccontextmanager
async def _recording(request: Request, state: AppState, entry: audit.AuditEntry) -> AsyncIterator[None]:
    try:
        yield
    except Exception as exc:
        detail = getattr(request.state, "audit_detail", None)
        await audit.record(state.sessionmaker, dataclasses.replace(entry, result=_audit_result(exc), detail=detail))
        raise
    detail, result = getattr(request.state, "audit_detail", None), getattr(request.state, "audit_result", entry.result)
    await audit.record(state.sessionmaker, dataclasses.replace(entry, detail=detail, result=result))


def _target(request: Request) -> str | None:
    return _printable("/".join(str(v) for v in request.path_params.values())) or None


# NOTE: the operator's credential (KVCHAT_OPERATOR_TOKEN), declared for /docs; a tenant's key never passes.
OPERATOR_BEARER = HTTPBearer(
    auto_error=False, scheme_name="OperatorToken", description="the operator token (KVCHAT_OPERATOR_TOKEN)"
)
OPERATOR_ACTOR = "operator"


def operator_access(request: Request, expected: str | None, env_name: str) -> None:
    """Operator-only routes: with a token configured, the request must carry it as a bearer token (401 otherwise);
    without one, only clients on this machine (loopback) are answered (403 otherwise)."""
    if expected is not None:
        if not hmac.compare_digest(bearer_token(request).encode(), expected.encode()):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                f"send the operator's token ({env_name}) as a bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
    elif not is_loopback(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"set {env_name} to reach this route from another machine")


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def get_operator(
    request: Request,
    state: StateDep,
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(OPERATOR_BEARER)] = None,
) -> str:
    """The operator (engine-global settings): ``KVCHAT_OPERATOR_TOKEN``, else a loopback client. Returns the actor."""
    operator_access(request, state.settings.operator_token, "KVCHAT_OPERATOR_TOKEN")
    return OPERATOR_ACTOR


OperatorDep = Annotated[str, Depends(get_operator)]


def operator_audited(action: str) -> Any:
    """``audited`` for operator routes: one ``admin_audit`` row without a tenant (actor ``operator``)."""

    async def record(request: Request, actor: OperatorDep, state: StateDep) -> AsyncIterator[None]:
        entry = audit.AuditEntry(None, actor, action, _target(request), audit.OK)
        async with _recording(request, state, entry):
            yield

    dependency: Callable[..., Any] = record
    return Depends(dependency, scope="function")


def _printable(text: str, limit: int = 200) -> str:
    """A path value as it can be stored: NUL and lone surrogates escaped (a refused request is audited too)."""
    escaped = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return escaped[:limit]


def _audit_result(exc: BaseException) -> str:
    if isinstance(exc, RequestValidationError):
        return "invalid_request"
    if isinstance(exc, StarletteHTTPException):
        code = getattr(exc, "code", None)
        return code if isinstance(code, str) else HTTP_STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return audit.result_of(exc)
