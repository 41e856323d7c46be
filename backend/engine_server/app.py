"""The engine server's app: one ``LLMEngine``, started by the lifespan, behind the routes of ``completions`` and
``control``; every error in one JSON shape (``errors``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from backend.engine_client.model_id import served_model_id
from backend.engine_server import completions, control, errors
from engine.llm_engine import LLMEngine


def create_engine_app(engine: LLMEngine, secret: str | None, *, owns_engine: bool = True) -> FastAPI:
    """The app over ``engine``; with ``owns_engine`` the lifespan starts it (loading the model) and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owns_engine:
            await engine.start()
        try:
            yield
        finally:
            if owns_engine:
                await engine.stop()

    app = FastAPI(title="kvchat engine", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.engine_secret = secret or None
    app.state.model_id = served_model_id(engine.config.model)
    errors.install(app)
    app.include_router(control.public)
    app.include_router(control.router)
    app.include_router(completions.router)
    return app
