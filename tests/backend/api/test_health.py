"""/livez and /readyz through the real app factory and lifespan (migrations run at start)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backend.core.config import Settings
from backend.main import create_app
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.anyio


async def _get(settings: Settings, path: str, engine: LLMEngine) -> httpx.Response:
    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)


async def test_livez_is_ok(tmp_path: Path, tiny_engine: LLMEngine) -> None:
    resp = await _get(Settings(data_dir=tmp_path), "/livez", tiny_engine)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


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
