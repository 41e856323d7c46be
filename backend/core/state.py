"""What the app's lifespan owns: settings, the database engine, the inference engine, the chat service."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from backend.chat.service import ChatService
from backend.core.admission import Admission
from backend.core.config import Settings
from backend.core.metrics import Metrics
from backend.core.namespaces import Namespaces
from engine.llm_engine import LLMEngine


@dataclass(slots=True)
class AppState:
    settings: Settings
    db_engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    engine: LLMEngine
    chat: ChatService
    metrics: Metrics
    namespaces: Namespaces  # every engine call's cache namespace comes from here (backend/core/namespaces.py)
    admission: Admission = field(default_factory=Admission)  # /v1 requests in flight (backend/core/admission.py)
