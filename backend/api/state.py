"""What the app's lifespan builds and the routes read (``backend/api/deps.py``): settings, the database engine, the
inference engine (behind its interface), the chat and ``/v1`` services."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from backend.chat.service import ChatService
from backend.core.admission import Admission
from backend.core.config import Settings
from backend.core.heap import FreedMemoryReleaser
from backend.core.metrics import Metrics
from backend.core.namespaces import Namespaces
from backend.core.tenant_quota import QuotaGate
from backend.engine_client.protocol import EngineClient
from backend.openai.service import ChatCompletions


@dataclass(slots=True)
class AppState:
    settings: Settings
    db_engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    engine: EngineClient
    chat: ChatService
    completions: ChatCompletions  # /v1
    metrics: Metrics
    namespaces: Namespaces  # every engine call's cache namespace comes from here (backend/core/namespaces.py)
    admission: Admission  # /v1 requests in flight (backend/core/admission.py)
    quotas: QuotaGate  # the tenants' weights and quotas, and their use (backend/core/tenant_quota.py)
    heap: FreedMemoryReleaser  # told when a socket or request closes: what it held goes back (backend/core/heap.py)
