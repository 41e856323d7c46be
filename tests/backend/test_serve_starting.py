"""``kvchat serve`` listens while it starts (issue 27): ``/livez`` names the phase, ``/readyz`` stays 503, the chat and
the API answer a clear ``starting`` error (never a hang or a 500), and the log has one line per phase, no progress bar.

The test holds the start in its ``migrating`` phase with a lock on ``alembic_version`` (the migrations wait for it),
so nothing here depends on how fast this CPU loads or converts a model. The model is a tiny GGUF with an empty model
cache: a first start, which converts it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import websockets
from sqlalchemy.engine import make_url

from engine.testing import build_tiny_gguf
from support.server import ADMIN_KEY, CHAT_TOKEN
from support.server_process import ServerProcess, launch_server_process, tiny_server_env

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

DEADLINE_S = 120.0
TRY_AGAIN_LATER = 1013
STARTING = "kvchat is starting (migrating); retry in a few seconds"


async def _until_phase(server: ServerProcess, phase: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (seen := await asyncio.to_thread(server.phase)) != phase:
        assert time.monotonic() < deadline, f"the start never reached {phase!r} (last seen: {seen!r})"
        await asyncio.sleep(0.1)


async def _chat_refusal(url: str) -> tuple[dict[str, Any], int | None]:
    """What a chat client hears from a server that is starting: its first frame, then the close code."""
    async with websockets.connect(url, open_timeout=DEADLINE_S) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), DEADLINE_S)
    return frame, closed.value.rcvd.code if closed.value.rcvd is not None else None


async def test_a_first_start_answers_starting_until_it_is_ready(pg_url: str, tmp_path: Path) -> None:
    gguf = build_tiny_gguf(tmp_path / "tiny.gguf")
    lock = await asyncpg.connect(make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False))
    hold = lock.transaction()
    await hold.start()
    await lock.execute("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE")
    env = tiny_server_env(
        pg_url,
        gguf,
        tmp_path,
        run_migrations_on_start="true",
        cache_dir=str(tmp_path / "model-cache"),  # empty: this start converts the GGUF
        disable_kernels=1,  # (KVCHAT_DISABLE_KERNELS: no C build into the fresh cache; not what this test is about)
    )
    server = await asyncio.to_thread(launch_server_process, env, tmp_path / "serve.log")
    try:
        await _until_phase(server, "migrating")
        async with httpx.AsyncClient(base_url=server.http, timeout=DEADLINE_S) as http:
            live = await http.get("/livez")
            ready = await http.get("/readyz")
            stats = await http.get("/admin/stats", headers={"X-API-Key": ADMIN_KEY})
            models = await http.get("/v1/models", headers={"Authorization": f"Bearer {CHAT_TOKEN}"})
        frame, close_code = await _chat_refusal(server.ws)
        client = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "backend.cli", "chat", "--url", server.ws, "--token", CHAT_TOKEN],
            input="Hello?\n",
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        await hold.rollback()  # the migrations go on
        await _until_phase(server, "ready")
        async with httpx.AsyncClient(base_url=server.http, timeout=DEADLINE_S) as http:
            ready_after = await http.get("/readyz")
    finally:
        await lock.close()
        server.terminate()

    assert (live.status_code, live.json()) == (200, {"status": "ok", "phase": "migrating"})
    assert (ready.status_code, ready.json()) == (503, {"status": "starting", "phase": "migrating"})
    assert (stats.status_code, stats.json(), stats.headers["retry-after"]) == (
        503,
        {"detail": STARTING, "code": "starting"},
        "5",
    )
    assert (models.status_code, models.json()) == (
        503,
        {"error": {"message": STARTING, "type": "server_error", "param": None, "code": "starting"}},
    )
    assert frame == {
        "type": "error",
        "code": "starting",
        "message": STARTING,
        "retry_after_ms": 5000,
        "client_msg_id": None,
    }
    assert close_code == TRY_AGAIN_LATER
    assert (client.returncode, client.stderr) == (1, f"error: the server refused the session: {STARTING}\n")
    assert ready_after.status_code == 200, ready_after.text

    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    assert "\r" not in log and "it/s" not in log, log[-3000:]  # no progress bar, only lines
    phases = [m.group(1) for m in re.finditer(r" kvchat: start \d+\.\ds: (.*)", log)]
    assert phases == [
        "migrating the database",
        f"loading the model {gguf}",
        "converting it to a safetensors cache, once (30 s or more on 2 cores)",
        "loading the converted model",
        "marking replies a crash cut off, pinning prefixes",
        f"kvchat ready: chat page {server.http}/chat (websocket /ws/chat), dashboard {server.http}/dashboard, "
        f"API docs {server.http}/docs",
    ], log[-3000:]
