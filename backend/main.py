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
from fastapi.staticfiles import StaticFiles
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.api import boundary, docs
from backend.api.routes import (
    admin_audit,
    admin_cache,
    admin_rules,
    admin_sessions,
    admin_stats,
    admin_tenant,
    chat_ws,
    health,
    openai_api,
)
from backend.api.routes import metrics as metrics_route
from backend.chat.hub import SessionHub
from backend.chat.service import ChatService, ReplyConfig
from backend.core.config import Settings
from backend.core.heap import long_lived_heap_frozen
from backend.core.logs import RequestIdMiddleware
from backend.core.metrics import Metrics, instrument_database
from backend.core.namespaces import Namespaces, load_secret
from backend.core.state import AppState
from backend.db import migrate
from backend.db.engine import create_db_engine, create_sessionmaker, peer_workers, worker_name
from backend.services import cache_admin
from backend.services.context_service import ContextService
from backend.services.tenants import BootstrapResult, bootstrap_default_tenant
from engine.llm_engine import LLMEngine

log = logging.getLogger("kvchat")
from backend.services.revocation import RevocationFeed
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
        name = worker_name()
        db_engine = create_db_engine(url, application_name=name)
        sessionmaker = create_sessionmaker(db_engine)
        metrics = Metrics()
        namespaces = Namespaces(load_secret(settings.secret_key, settings.data_dir))
        boot = await bootstrap_default_tenant(sessionmaker, settings.bootstrap_chat_token, settings.bootstrap_admin_key)
        _announce_keys(boot)
        own_engine = engine is None
        llm = engine or LLMEngine(settings.engine_config())
        if not llm.is_running:
            log.info("loading model %s (the first start converts it once)…", settings.model)
            await llm.start()
        reply = ReplyConfig(settings.reply_max_tokens, settings.reply_temperature, settings.reply_top_p)
        metrics.watch_engine(llm)
        instrument_database(db_engine, metrics)
        context = ContextService(sessionmaker, llm, namespaces)
        chat = ChatService(sessionmaker, llm, SessionHub(), context, reply, settings.test_commit_delay_seconds, metrics)
        await _recover_interrupted_turns(chat, db_engine, name)
        pinned = await cache_admin.pin_at_start(sessionmaker, llm, namespaces)
        if pinned:
            log.info("pinned the system + policy prefix of %d tenant(s)", pinned)
        app.state.kvchat = AppState(settings, db_engine, sessionmaker, llm, chat, metrics, namespaces)
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
            cut = await chat.drain(settings.shutdown_grace_seconds)  # a no-op after kvchat serve's own drain
            if cut.cut_off:
                log.warning("shutdown cut off %d repl(ies); stored as incomplete", cut.cut_off)
            if own_engine:
                await llm.stop()
            await db_engine.dispose()

    app = FastAPI(title="kvchat", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    boundary.install(app, settings.max_request_bytes)
    app.add_middleware(RequestIdMiddleware)
    docs.install(app)
    app.include_router(health.router)
    app.include_router(chat_ws.router)
    app.include_router(admin_sessions.router)
    app.include_router(openai_api.router)
    app.include_router(metrics_route.router)
    app.include_router(admin_stats.router)
    app.include_router(admin_tenant.router)
    app.include_router(admin_rules.router)
    app.include_router(admin_audit.router)
    app.include_router(admin_cache.router)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/chat")

    @app.get("/chat", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "chat.html", media_type="text/html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "dashboard.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=FRONTEND_DIR), name="static")

    return app


async def _recover_interrupted_turns(chat: ChatService, db_engine: AsyncEngine, name: str) -> None:
    # NOTE: another live process's awaiting messages are its turns in flight, so recovery runs only when this
    # process is alone on the database. With several workers, a crashed one's turns are marked at the next start
    # that finds itself alone (until then, a customer's retry answers them).
    peers = await peer_workers(db_engine, name)
    if peers:
        log.info("%d other kvchat process(es) on this database: cut-off turns are left to a lone start", peers)
        return
    marked = await chat.recover_interrupted()
    if marked:
        log.warning("marked %d repl(ies) cut off by a crash as incomplete", marked)


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
    revocations = RevocationFeed(url, sessionmaker, chat.hub.keys)  # revoked keys close their sockets, any process
    revocations.start()
    owned.push_async_callback(revocations.stop)
