"""FastAPI app factory. The lifespan owns the database engine, the inference engine and the chat service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse

from backend.api import boundary
from backend.api.routes import admin_sessions, chat_ws, health, openai_api
from backend.chat.hub import SessionHub
from backend.chat.service import ChatService, ReplyConfig
from backend.core.config import Settings
from backend.core.heap import long_lived_heap_frozen
from backend.core.state import AppState
from backend.db import migrate
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.services.tenants import BootstrapResult, bootstrap_default_tenant
from engine.llm_engine import LLMEngine

log = logging.getLogger("kvchat")
FRONTEND_DIR = Path(__file__).resolve().parents[1] / "frontend_stub"


def create_app(settings: Settings | None = None, engine: LLMEngine | None = None) -> FastAPI:
    """Build the app. Pass ``engine`` to share an already-built engine (the caller then owns its lifetime)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        if settings.run_migrations_on_start:
            # NOTE: Alembic's env.py runs its own event loop, so it must not run on this one.
            await asyncio.to_thread(migrate.upgrade, url)
        db_engine = create_db_engine(url)
        sessionmaker = create_sessionmaker(db_engine)
        boot = await bootstrap_default_tenant(sessionmaker, settings.bootstrap_chat_token, settings.bootstrap_admin_key)
        _announce_keys(boot)
        own_engine = engine is None
        llm = engine or LLMEngine(settings.engine_config())
        if not llm.is_running:
            log.info("loading model %s (the first start converts it once)…", settings.model)
            await llm.start()
        reply = ReplyConfig(settings.reply_max_tokens, settings.reply_temperature, settings.reply_top_p)
        chat = ChatService(sessionmaker, llm, SessionHub(), reply)
        app.state.kvchat = AppState(settings, db_engine, sessionmaker, llm, chat)
        sweeper = asyncio.create_task(_sweep_idle_sessions(chat, settings.session_timeout_seconds))
        base = f"http://{settings.host}:{settings.port}"
        log.info("kvchat ready: chat page %s/chat (websocket /ws/chat), API docs %s/docs", base, base)
        try:
            with long_lived_heap_frozen():  # (full GC passes would otherwise stall every request: backend/core/heap.py)
                yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await chat.shutdown()
            if own_engine:
                await llm.stop()
            await db_engine.dispose()

    app = FastAPI(title="kvchat", version="0.1.0", lifespan=lifespan)
    boundary.install(app, settings.max_request_bytes)
    app.include_router(health.router)
    app.include_router(chat_ws.router)
    app.include_router(admin_sessions.router)
    app.include_router(openai_api.router)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/chat")

    @app.get("/chat", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "chat.html", media_type="text/html")

    return app


async def _sweep_idle_sessions(chat: ChatService, timeout_s: int) -> None:
    interval = max(1.0, min(60.0, timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            closed = await chat.close_idle(timedelta(seconds=timeout_s))
        except Exception:
            log.exception("closing idle sessions failed; retrying in %.0fs", interval)
            continue
        if closed:
            log.info("closed %d idle session(s)", len(closed))


def _announce_keys(boot: BootstrapResult) -> None:
    if boot.created:
        log.info("created the default tenant %s", boot.tenant_id)
    if boot.generated_chat_token:
        # NOTE: printed once, on the first start; only a hash is stored. Set KVCHAT_BOOTSTRAP_* to choose them.
        print(f"kvchat: default tenant chat token (also an OpenAI API key): {boot.generated_chat_token}", flush=True)
    if boot.generated_admin_key:
        print(f"kvchat: default tenant admin API key: {boot.generated_admin_key}", flush=True)
