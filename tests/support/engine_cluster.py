"""Engine replicas (``kvchat engine-serve``) and a vllm-router in front of them, as real processes on loopback, for
the scale-out tests (docs/scale-out.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support.server import free_port
from support.server_process import REPO_ROOT

SECRET = "scale-out-test-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
ROUTER = Path(sys.executable).parent / "vllm-router"


@dataclass(slots=True)
class Process:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """kill -9: no goodbye to anyone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.log_path.name} was not healthy within {timeout_s:.0f}s:\n{self.log()}")


@dataclass(slots=True)
class Replica(Process):
    """One ``kvchat engine-serve``, with its own client for its ``/kvchat`` routes."""

    http: httpx.Client = field(default_factory=lambda: httpx.Client(headers=AUTH, timeout=30))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.http.get(f"{self.url}/kvchat/stats").json()
        return out

    def finished(self) -> int:
        return int(self.stats()["requests_finished"])

    def stop(self) -> None:
        Process.stop(self)
        self.http.close()

    def kill(self) -> None:
        Process.kill(self)
        self.http.close()

    def footprint(self, session: str) -> int:
        return int(self.http.post(f"{self.url}/kvchat/sessions/footprint", json={"session": session}).json()["blocks"])


def _launch(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(args, cwd=REPO_ROOT, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT)


def start_replica(
    model_dir: Path, data_dir: Path, log_path: Path, port: int | None = None, **settings: object
) -> Replica:
    """``kvchat engine-serve`` on ``port`` (default: a free one) with the tiny model (fp32, no disk tier); returns at
    once (``wait_healthy`` waits for its load)."""
    port = port or free_port()
    env = {
        "KVCHAT_MODEL": str(model_dir),
        "KVCHAT_ENGINE_DEVICE": "cpu",
        "KVCHAT_ENGINE_DTYPE": "float32",
        "KVCHAT_MAX_KV_MEMORY_MB": "8",
        "KVCHAT_KV_DISK_CACHE": "false",
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_ENGINE_SECRET": SECRET,
        "KVCHAT_LOG_LEVEL": "warning",
    } | {f"KVCHAT_{k.upper()}": str(v) for k, v in settings.items()}
    args = [sys.executable, "-m", "backend.cli", "engine-serve", "--port", str(port)]
    return Replica(_launch(args, env, log_path), port, log_path)


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback now (a check, not a reservation), as uvicorn binds it: a closed
    connection's TIME_WAIT on it is no conflict."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_router(workers: list[str], log_path: Path, policy: str = "consistent_hash") -> Process:
    """vllm-router in front of ``workers``; its health check drops a dead worker within about a second."""
    port = free_port()
    args = [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
        "--prometheus-port", str(free_port()), "--health-check-endpoint", "/health",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warning",
    ]  # fmt: skip
    return Process(_launch(args, {}, log_path), port, log_path)
