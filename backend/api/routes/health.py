"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from backend.api.deps import StateDep
from backend.core.state import AppState

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(state: StateDep) -> JSONResponse:
    """Ready for traffic: the database answers, the engine's step loop serves its loaded model, and the server is not
    draining (a SIGTERM stops new turns first); 503 otherwise."""
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
