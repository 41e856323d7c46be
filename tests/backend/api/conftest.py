"""Admin API fixtures: ``live``, a real server on a fresh Postgres database with the tiny-model engine (a test module
that needs other settings or another engine defines its own ``live``, which wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm_engine import LLMEngine
from support.server import LiveServer, server_settings, serving


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path), tiny_engine) as server:
        yield server
