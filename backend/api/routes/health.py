"""Liveness and readiness probes.

``/livez`` answers as soon as the process serves HTTP, with the phase of its start (``backend/core/startup.py``):
``kvchat serve`` listens while it migrates, converts and loads the model. ``/readyz`` is 503 until the start is done,
and afterwards whenever the database, the engine or the chat is not serving.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from backend.api.state import AppState
from backend.core.startup import Startup

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez(request: Request) -> dict[str, str]:
    """The process is up and serving HTTP; ``phase`` says how far its start is (``ready`` once it is done)."""
    startup: Startup = request.app.state.startup
    return {"status": "ok", "phase": startup.phase.value}


@router.get("/readyz", response_model=None)
async def readyz(request: Request) -> JSONResponse:
    """Ready for traffic: the start is done, the database answers, the engine's step loop serves its loaded model, and
    the server is not draining (a SIGTERM stops new turns first); 503 otherwise."""
    startup: Startup = request.app.state.startup
    state: AppState | None = getattr(request.app.state, "kvchat", None)
    if state is None or not startup.ready:  # (why a start failed is in the log, not on this public route)
        body = {"status": "starting" if startup.error is None else "failed", "phase": startup.phase.value}
        return JSONResponse(body, status_code=503)
    checks = {
        "database": await _database(state),
        "engine": "ok" if state.engine.is_running else "stopped",
        "chat": "ok" if state.chat.accepting else "draining",
    }
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ready else "unavailable", **checks}, status_code=200 if ready else 503)


async def _database(state: AppState) -> str:
    try:
        async with state.db_engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"; the reason goes in the body
        return type(exc).__name__
    return "ok"
