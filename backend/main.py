"""FastAPI app factory. The lifespan owns the database engine (and, once wired, the inference engine)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from backend.api.routes import health
from backend.core.config import Settings
from backend.core.state import AppState
from backend.db import migrate
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.services.tenants import BootstrapResult, bootstrap_default_tenant

log = logging.getLogger("kvchat")


def create_app(settings: Settings | None = None) -> FastAPI:
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
        app.state.kvchat = AppState(settings=settings, db_engine=db_engine, sessionmaker=sessionmaker)
        base = f"http://{settings.host}:{settings.port}"
        log.info("kvchat ready: API docs %s/docs, health %s/livez", base, base)
        try:
            yield
        finally:
            await db_engine.dispose()

    app = FastAPI(title="kvchat", version="0.1.0", lifespan=lifespan)
    app.include_router(health.router)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/docs")

    return app


def _announce_keys(boot: BootstrapResult) -> None:
    if boot.created:
        log.info("created the default tenant %s", boot.tenant_id)
    if boot.generated_chat_token:
        # NOTE: printed once, on the first start; only a hash is stored. Set KVCHAT_BOOTSTRAP_* to choose them.
        print(f"kvchat: default tenant chat token (also an OpenAI API key): {boot.generated_chat_token}", flush=True)
    if boot.generated_admin_key:
        print(f"kvchat: default tenant admin API key: {boot.generated_admin_key}", flush=True)
