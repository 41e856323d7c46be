"""What the app's lifespan owns: settings, the database engine, (later) the inference engine."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from backend.core.config import Settings


@dataclass(slots=True)
class AppState:
    settings: Settings
    db_engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
