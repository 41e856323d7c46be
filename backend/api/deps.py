"""Shared FastAPI dependencies, as ``Annotated`` aliases (one place, imported by every router)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.config import Settings
from backend.core.state import AppState


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
