"""A real uvicorn server running the app on a free port (for websocket/HTTP end-to-end tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.config import Settings
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import KeyKind
from backend.main import create_app
from backend.services.tenants import add_key, create_tenant
from engine.llm_engine import LLMEngine

CHAT_TOKEN = "test-chat-token"
ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class LiveServer:
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.settings.port}/ws/chat"

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return self.server.config.app.state.kvchat  # type: ignore[union-attr]


def start_server(settings: Settings, engine: LLMEngine | None) -> LiveServer:
    app = create_app(settings, engine=engine)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", ws="websockets-sansio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(settings, server, thread)


def stop_server(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(30)


@contextmanager
def serving(settings: Settings, engine: LLMEngine | None) -> Iterator[LiveServer]:
    """A started server for the ``with`` block, stopped afterwards."""
    live = start_server(settings, engine)
    try:
        yield live
    finally:
        stop_server(live)


def server_settings(database_url: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "data_dir": tmp_path,
        "database_url": database_url,
        "port": free_port(),
        "bootstrap_chat_token": CHAT_TOKEN,
        "bootstrap_admin_key": ADMIN_KEY,
        "reply_max_tokens": 12,
        "run_migrations_on_start": True,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@asynccontextmanager
async def db_session(live: LiveServer) -> AsyncIterator[AsyncSession]:
    """A DB session on the test's own event loop (the server's pool belongs to the server's loop)."""
    engine = create_db_engine(live.settings.resolved_database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            yield session
    finally:
        await engine.dispose()


async def add_chat_tenant(live: LiveServer, name: str, key: str) -> str:
    """A second tenant with a chat key, stored the way the admin CLI stores it; returns its id."""
    async with db_session(live) as db:
        tenant = await create_tenant(db, name)
        await add_key(db, tenant.id, KeyKind.CHAT, key)
        await db.commit()
        return tenant.id
