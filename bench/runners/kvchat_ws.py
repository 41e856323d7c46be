"""(b) kvchat end to end: the real app (uvicorn, SQLite, the chat service) in this process, driven over websockets.

One websocket per session, kept open across its turns, exactly as the chat widget does. Each tenant of the workload
becomes a tenant of the server, with the workload's system prompt and its own chat key.

NOTE: the server builds each prompt from *its own* stored history, so the assistant messages in the history are the
model's replies (capped at ``max_tokens``), not the recorded agent turns the other systems see: the protocol has no
way to inject them. Prompts are therefore shorter than the other systems' from turn 2 on; the prompt and cached token
counts reported are the server's own (the ``usage`` of ``message.completed``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.runners.base import OnTokens, Runner, RunnerInfo, TurnOutcome, TurnRequest
from bench.runners.kvchat_engine import kv_resident_bytes
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

_TURN_TIMEOUT_S = 600.0


class HandedToHuman(RuntimeError):
    """The server stopped answering this session (the customer asked for a human)."""


def free_port() -> int:
    """A port nothing listens on now (the OS picks it), for a server this process starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KvchatWebsocketRunner(Runner):
    def __init__(self, config: EngineConfig, max_tokens: int, name: str = "kvchat-ws") -> None:
        self.name = name
        self.engine = LLMEngine(config)
        self.max_tokens = max_tokens
        self._tmp = tempfile.TemporaryDirectory(prefix="kvchat-bench-ws-")
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._port = free_port()
        self._sockets: dict[str, Any] = {}
        self._tokens: dict[str, str] = {}
        self._tenant_lock = asyncio.Lock()
        self._db: Any = None

    async def start(self) -> RunnerInfo:
        import uvicorn

        from backend.core.config import Settings
        from backend.db.engine import create_db_engine, create_sessionmaker
        from backend.main import create_app

        info = await self.engine.start()
        settings = Settings(
            data_dir=Path(self._tmp.name),
            port=self._port,
            reply_max_tokens=self.max_tokens,
            run_migrations_on_start=True,
            ws_rate_per_second=1000.0,
            ws_rate_burst=1000,
            max_connections_per_tenant=10_000,
            bootstrap_chat_token="bench-default-chat-token",
            bootstrap_admin_key="bench-default-admin-key",
            log_level="warning",
        )
        app = create_app(settings, engine=self.engine)
        config = uvicorn.Config(app, host="127.0.0.1", port=self._port, log_level="warning", ws="websockets-sansio")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="bench-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the kvchat server did not start")
            await asyncio.sleep(0.05)
        self._db = create_sessionmaker(create_db_engine(settings.resolved_database_url))
        return RunnerInfo(self.name, "dev", {"dtype": info.dtype, "url": f"ws://127.0.0.1:{self._port}/ws/chat"})

    async def _token_for(self, tenant: str, system_prompt: str) -> str:
        from backend.domain import KeyKind
        from backend.services.tenants import add_key, create_tenant

        async with self._tenant_lock:
            if tenant not in self._tokens:
                token = f"bench-chat-{tenant}-{uuid.uuid4().hex[:8]}"
                async with self._db() as db:
                    row = await create_tenant(db, f"bench-{tenant}", system_prompt)
                    await add_key(db, row.id, KeyKind.CHAT, token)
                    await db.commit()
                self._tokens[tenant] = token
            return self._tokens[tenant]

    async def _socket(self, request: TurnRequest) -> Any:
        import websockets

        ws = self._sockets.get(request.session_id)
        if ws is None:
            system = request.messages[0]["content"] if request.messages[0]["role"] == "system" else ""
            token = await self._token_for(request.tenant, system)
            ws = await websockets.connect(f"ws://127.0.0.1:{self._port}/ws/chat", max_size=2**22)
            await ws.send(json.dumps({"type": "hello", "token": token}))
            welcome = json.loads(await ws.recv())
            if welcome.get("type") != "welcome":
                raise RuntimeError(f"the server refused the session: {welcome}")
            self._sockets[request.session_id] = ws
        return ws

    async def run_turn(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome:
        ws = await self._socket(request)
        msg_id = uuid.uuid4().hex
        await ws.send(
            json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": request.messages[-1]["content"]})
        )
        async with asyncio.timeout(_TURN_TIMEOUT_S):
            while True:
                frame = json.loads(await ws.recv())
                kind = frame.get("type")
                if kind == "message.delta" and frame.get("client_msg_id") == msg_id:
                    on_tokens(1)
                elif kind == "message.completed" and frame.get("client_msg_id") == msg_id:
                    usage = frame.get("usage") or {}
                    return TurnOutcome(
                        int(usage.get("prompt_tokens", 0)),
                        int(usage.get("cached_tokens", 0)),
                        int(usage.get("completion_tokens", 0)),
                        kv_resident_bytes(self.engine),
                    )
                elif kind == "error":
                    raise RuntimeError(f"server error {frame.get('code')}: {frame.get('message')}")
                elif kind == "session.status" and frame.get("status") != "bot_active":
                    raise HandedToHuman(f"the server handed the session to a human ({frame.get('status')})")

    async def end_session(self, session_id: str) -> None:
        ws = self._sockets.pop(session_id, None)
        if ws is not None:
            await ws.close()

    async def close(self) -> None:
        for session_id in list(self._sockets):
            await self.end_session(session_id)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        await self.engine.stop()
        self._tmp.cleanup()

    def kv_bytes(self) -> int | None:
        return kv_resident_bytes(self.engine)

    def kv_capacity_bytes(self) -> int | None:
        info = self.engine.info
        return info.num_blocks * info.block_size * info.kv_bytes_per_token
