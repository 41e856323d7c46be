"""Shared FastAPI dependencies, as ``Annotated`` aliases (one place, imported by every router)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.config import Settings
from backend.core.state import AppState
from backend.db.models import KeyKind, Tenant
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


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


async def get_admin_tenant(request: Request, db: DbDep) -> Tenant:
    """The tenant whose *admin* key authorizes this request (``Authorization: Bearer`` or ``X-API-Key``)."""
    tenant = await authenticate(db, bearer_token(request), KeyKind.ADMIN)
    if tenant is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "a valid admin API key is required", headers={"WWW-Authenticate": "Bearer"}
        )
    return tenant


AdminDep = Annotated[Tenant, Depends(get_admin_tenant)]
