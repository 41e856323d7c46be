"""``kvchat serve`` as a real subprocess on a free port: started with a given env, killed with SIGKILL or SIGTERM.

For the tests that need what an in-process server cannot give: a process that dies (kill -9) mid-turn, and uvicorn's
own signal handling (SIGTERM drains the chat, then closes the sockets).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from support.server import ADMIN_KEY, CHAT_TOKEN, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_SECRET = "kvchat-tests-cache-secret"


def tiny_server_env(database_url: str, model_dir: Path, data_dir: Path, **settings: object) -> dict[str, str]:
    """The env of a server on ``database_url`` with the tiny test model; ``settings`` are more ``KVCHAT_*`` values
    (``reply_max_tokens=50`` → ``KVCHAT_REPLY_MAX_TOKENS=50``)."""
    env = {
        "KVCHAT_DATABASE_URL": database_url,
        "KVCHAT_MODEL": str(model_dir),
        "KVCHAT_ENGINE_DEVICE": "cpu",
        "KVCHAT_ENGINE_DTYPE": "float32",
        "KVCHAT_MAX_KV_MEMORY_MB": "8",
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": CHAT_TOKEN,
        "KVCHAT_BOOTSTRAP_ADMIN_KEY": ADMIN_KEY,
        # NOTE: one secret for every server a test starts: workers on one database must share it (else refused)
        "KVCHAT_SECRET_KEY": TEST_SECRET,
        "KVCHAT_LOG_LEVEL": "warning",
    }
    env.update({f"KVCHAT_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat"

    def kill(self) -> None:
        """kill -9: no drain, no lifespan shutdown, no goodbye to the database."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for the exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def phase(self) -> str | None:
        """The phase ``/livez`` names, or None while nothing listens yet; raises when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvchat serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            response = httpx.get(f"{self.http}/livez", timeout=10)
        except httpx.TransportError:
            return None
        phase: str = response.json()["phase"]
        return phase


def start_server_process(
    env: dict[str, str], log_path: Path, timeout_s: float = 300.0, port: int | None = None
) -> ServerProcess:
    """Start ``kvchat serve`` with ``env`` (on top of this process's env) and wait until its start is done (``/livez``
    answers from the first moment, with the phase: ``ready`` when it is done). ``port``: a given one (a restart on
    the port its clients know), else a free one."""
    server = launch_server_process(env, log_path, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.phase() == "ready":
            return server
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"kvchat serve was not ready within {timeout_s:.0f}s:\n{server.log()[-4000:]}")


def launch_server_process(env: dict[str, str], log_path: Path, port: int | None = None) -> ServerProcess:
    """Start ``kvchat serve`` with ``env`` and return at once (it listens before its start is done)."""
    port = port or free_port()
    full_env = os.environ | {"KVCHAT_HOST": "127.0.0.1", "KVCHAT_PORT": str(port)} | env
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"],
            cwd=REPO_ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return ServerProcess(proc, port, log_path)
