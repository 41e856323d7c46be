"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from backend.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(state: StateDep) -> JSONResponse:
    """The database answers; 503 otherwise."""
    try:
        async with state.db_engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"; the reason goes in the body
        return JSONResponse({"status": "unavailable", "database": type(exc).__name__}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok"})
