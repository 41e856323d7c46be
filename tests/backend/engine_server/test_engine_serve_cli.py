"""``kvchat engine-serve`` and ``kvchat serve`` with ``KVCHAT_ENGINE_URL``: what they refuse, each in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.server import free_port
from support.server_process import REPO_ROOT


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        cwd=REPO_ROOT, env=base | env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_a_replica_off_loopback_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    done = _run({"KVCHAT_DATA_DIR": str(tmp_path)}, "engine-serve", "--host", "0.0.0.0", "--port", str(free_port()))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "error: refusing to serve the engine on 0.0.0.0 without a secret: set KVCHAT_ENGINE_SECRET"
    )
    assert "Traceback" not in done.stderr


def test_a_backend_whose_replica_is_down_exits_with_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    env = {
        "KVCHAT_DATA_DIR": str(tmp_path),
        "KVCHAT_MODEL": str(tiny_model_dir),
        "KVCHAT_PORT": str(free_port()),
        "KVCHAT_ENGINE_URL": dead,
        "KVCHAT_ENGINE_TIMEOUT_S": "2",
    }
    done = _run(env, "serve")
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: kvchat could not start: while loading model: the engine replica "), last
    assert f"{dead} cannot be reached" in last
    assert "Traceback" not in done.stderr
