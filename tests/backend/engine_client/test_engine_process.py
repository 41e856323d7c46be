"""``KVCHAT_ENGINE_MODE=process`` with real processes: two ``kvchat serve`` workers on one machine share one engine
process (one model: neither worker loads torch; a session's turn 2 hits the cache on the other worker), and a
kill -9 of the engine leaves both workers up: ``/readyz`` reports the engine down, the reply it cut off is stored
``incomplete`` and named in ``cut_off``, the engine is started again, and the next turn succeeds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from support.server import CHAT_TOKEN
from support.server_process import ServerProcess, start_server_process, tiny_server_env
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
TIMEOUT_S = 60.0
REPLY = 300  # tokens (the tiny model never stops on its own): still streaming when the engine is killed
QUESTION = "Hello, I ordered a blue kettle last week and it has not arrived yet. Where is it now, please?"


@pytest.fixture(scope="module")
def workers(
    pg_module_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[ServerProcess], Path]]:
    data = tmp_path_factory.mktemp("process-mode")
    settings = {"engine_mode": "process", "reply_max_tokens": REPLY, "run_migrations_on_start": "false"}
    env = tiny_server_env(pg_module_url, tiny_model_dir, data, **settings)
    started: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            started.append(start_server_process(env, data / f"serve-{name}.log", timeout_s=120))
        yield started, data / "engine"
    finally:
        for server in started:
            server.terminate(30)


def _engine_pid(folder: Path) -> int:
    return int((folder / "engine.pid").read_text())


def _loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def _readyz(server: ServerProcess) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as http:
        body: dict[str, Any] = (await http.get(f"{server.http}/readyz")).json()
        return body


async def _until_engine(server: ServerProcess, state: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (await _readyz(server)).get("engine") != state:
        assert time.monotonic() < deadline, f"/readyz never said engine={state}"
        await asyncio.sleep(0.05)


async def test_two_workers_share_one_engine_and_its_cache(workers: tuple[list[ServerProcess], Path]) -> None:
    (a, b), folder = workers
    engine_pid = _engine_pid(folder)
    assert _loads_torch(engine_pid)
    assert not _loads_torch(a.proc.pid) and not _loads_torch(b.proc.pid)  # one model on the machine
    async with websockets.connect(a.ws) as ws_a:
        chat = Chat(ws_a)
        session = await chat.hello(CHAT_TOKEN)
        first = await chat.turn(QUESTION)
    async with websockets.connect(b.ws) as ws_b:
        await ws_b.send(json.dumps({"type": "hello", "token": CHAT_TOKEN, "session_id": session}))
        assert json.loads(await ws_b.recv())["type"] == "welcome"
        second = await Chat(ws_b).turn("And when will it arrive?")
    # NOTE: worker B has served nothing before: every token it finds cached was computed for turn 1 through worker A
    # (with an engine per worker it would find none). Turn 2's prompt repeats most of turn 1's (the system prompt and
    # the question; the context builder may place the end differently).
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // 2 > 0


async def test_kill_9_of_the_engine_is_survived(workers: tuple[list[ServerProcess], Path]) -> None:
    (a, b), folder = workers
    killed = _engine_pid(folder)
    async with websockets.connect(a.ws) as ws:
        chat = Chat(ws)
        session = await chat.hello(CHAT_TOKEN)
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "cut", "text": QUESTION}))
        while json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))["type"] != "message.delta":
            pass
        os.kill(killed, signal.SIGKILL)
        await _until_engine(a, "stopped")
        await _until_engine(b, "stopped")
        while True:  # the reply in flight ends with an error, never a hang
            frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            if frame["type"] in ("error", "message.completed"):
                break
        assert frame["type"] == "error" and frame["code"] == "unavailable", frame
    for server in (a, b):
        assert server.proc.poll() is None  # the workers stay up
        await _until_engine(server, "ok")
    assert _engine_pid(folder) != killed
    async with websockets.connect(b.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN, "session_id": session}))
        welcome = json.loads(await ws.recv())
        assert welcome["cut_off"] == [1], welcome
        done = await Chat(ws).turn("Are you there?")
        assert done["usage"]["completion_tokens"] > 0
