"""/livez and /readyz through the real app factory and lifespan (migrations run at start)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from backend.core.config import Settings
from backend.core.startup import Phase
from backend.main import create_app
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.anyio


async def _get(settings: Settings, path: str, engine: LLMEngine) -> httpx.Response:
    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)


async def test_livez_is_ok_and_names_the_phase(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    resp = await _get(Settings(data_dir=tmp_path), "/livez", tiny_engine)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "phase": "ready"}


async def test_livez_answers_before_any_start(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))  # no lifespan has run: nothing is started
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        live, ready = await client.get("/livez"), await client.get("/readyz")
        stats = await client.get("/admin/stats", headers={"X-API-Key": "any"})
    assert (live.status_code, live.json()) == (200, {"status": "ok", "phase": "starting"})
    assert (ready.status_code, ready.json()) == (503, {"status": "starting", "phase": "starting"})
    assert (stats.status_code, stats.json()) == (
        503,
        {"detail": "kvchat is starting (starting); retry in a few seconds", "code": "starting"},
    )
    assert stats.headers["retry-after"] == "5"


async def test_a_start_that_fails_while_serving_is_reported_not_raised(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    app = create_app(Settings(data_dir=tmp_path, model=str(missing)), serve_while_starting=True)
    async with app.router.lifespan_context(app):
        startup = app.state.startup
        deadline = time.monotonic() + 120
        while startup.phase is not Phase.FAILED:
            assert time.monotonic() < deadline, startup.phase
            await asyncio.sleep(0.05)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            live, ready = await client.get("/livez"), await client.get("/readyz")
            stats = await client.get("/admin/stats", headers={"X-API-Key": "any"})
    assert startup.error == f"while loading model: model path {str(missing)!r} does not exist"
    assert (live.status_code, live.json()) == (200, {"status": "ok", "phase": "failed"})
    assert (ready.status_code, ready.json()) == (503, {"status": "failed", "phase": "failed"})
    assert (stats.status_code, stats.json()) == (
        503,
        {"detail": "kvchat could not start; the server's log says why", "code": "starting"},
    )


async def test_a_start_that_fails_without_serving_raises(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, model=str(tmp_path / "no-model")))
    with pytest.raises(ModelLoadError, match="does not exist"):
        async with app.router.lifespan_context(app):
            pass
    assert app.state.startup.phase is Phase.FAILED


async def test_readyz_reports_database_ok_on_sqlite(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    resp = await _get(Settings(data_dir=tmp_path), "/readyz", tiny_engine)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "database": "ok", "engine": "ok", "chat": "ok"}
    assert (tmp_path / "kvchat.db").exists()


@pytest.mark.postgres
async def test_readyz_on_postgres(pg_empty_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> None:
    resp = await _get(Settings(data_dir=tmp_path, database_url=pg_empty_url), "/readyz", tiny_engine)
    assert resp.status_code == 200
    assert resp.json()["database"] == "ok"


async def test_openapi_docs_are_served(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    resp = await _get(Settings(data_dir=tmp_path), "/openapi.json", tiny_engine)
    assert resp.status_code == 200
    assert "/livez" in resp.json()["paths"]


async def test_chat_page_is_served_and_root_redirects_to_it(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    page = await _get(Settings(data_dir=tmp_path), "/chat", tiny_engine)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "/ws/chat" in page.text
    root = await _get(Settings(data_dir=tmp_path), "/", tiny_engine)
    assert root.status_code == 307
    assert root.headers["location"] == "/chat"


async def test_readyz_is_503_when_the_engine_is_not_running(tmp_path: Path, tiny_model_dir: Path) -> None:
    stopped = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_kv_memory_mb=8))
    app = create_app(Settings(data_dir=tmp_path), engine=stopped)
    async with app.router.lifespan_context(app):
        await stopped.stop()  # the lifespan started it; a dead step loop must take the process out of rotation
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            resp = await client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json() == {"status": "unavailable", "database": "ok", "engine": "stopped", "chat": "ok"}


async def test_readyz_is_503_while_draining(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    app = create_app(Settings(data_dir=tmp_path), engine=tiny_engine)
    async with app.router.lifespan_context(app):
        await app.state.kvchat.chat.drain(0.0)  # what SIGTERM does first: no new turns
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            resp = await client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json() == {"status": "unavailable", "database": "ok", "engine": "ok", "chat": "draining"}
