"""Backend fixtures: a real uvicorn server on a free port, serving the app with the tiny-model engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm_engine import LLMEngine
from support.server import LiveServer, server_settings, serving


@pytest.fixture
def live_server(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    """A real server (uvicorn + websockets) on SQLite and on Postgres, each with a fresh database."""
    with serving(server_settings(db_url, tmp_path), tiny_engine) as live:
        yield live
