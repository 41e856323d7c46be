"""A backend whose engine runs elsewhere does not load torch: a child process imports the app and the CLI, connects
to a real engine server (the tiny model's, served from this test's process), streams a reply, reads the engine's
stats, and reports whether ``torch`` is in ``sys.modules``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from backend.engine_server.app import create_engine_app
from engine.llm_engine import LLMEngine
from support.server import free_port

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import backend.cli, backend.main  # the whole app and the serve command
    from backend.engine_client.remote import RemoteEngine
    from backend.engine_client.values import RequestFinished, SamplingParams

    async def main(url: str, model: str) -> None:
        remote = RemoteEngine(url, model=model, timeout_s=30)
        await remote.start()
        events = [e async for e in remote.generate("hello there", SamplingParams(max_tokens=3), session="s1")]
        assert isinstance(events[-1], RequestFinished), events
        stats = await asyncio.to_thread(remote.stats)
        assert stats.requests_finished >= 1, stats
        await remote.stop()
        print("torch loaded:", "torch" in sys.modules)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.fixture(scope="module")
def engine_url(tiny_engine: LLMEngine) -> Iterator[str]:
    port = free_port()
    app = create_engine_app(tiny_engine, None, owns_engine=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_a_remote_mode_backend_never_imports_torch(engine_url: str, tiny_model_dir: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, engine_url, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "torch loaded: False"
