"""Shared FastAPI dependencies, as ``Annotated`` aliases (one place, imported by every router)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.exceptions import RequestValidationError
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.core.config import Settings
from backend.core.errors import HTTP_STATUS_CODES
from backend.core.security import display_prefix
from backend.core.state import AppState
from backend.db.models import KeyKind, Tenant
from backend.services import audit
from backend.services.tenants import authenticate


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.kvchat
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


def audited(action: str) -> Any:
    """A route dependency that writes one ``admin_audit`` row for the request: ``action``, the path's ids as the
    target, the admin key's prefix as the actor, and ``ok`` or the error's code. Requests refused before a tenant is
    known (401) are not audited: there is no tenant to file them under.

    NOTE: function scope, so the row is written before the response is sent (a client reading the audit right after
    its write sees it) and the route's exception, not yet mapped to a response, reaches it.
    """

    async def record(request: Request, tenant: AdminDep, state: StateDep) -> AsyncIterator[None]:
        target = _printable("/".join(str(v) for v in request.path_params.values())) or None
        entry = audit.AuditEntry(tenant.id, display_prefix(bearer_token(request)), action, target, audit.OK)
        try:
            yield
        except Exception as exc:
            await audit.record(state.sessionmaker, dataclasses.replace(entry, result=_audit_result(exc)))
            raise
        await audit.record(state.sessionmaker, entry)

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
