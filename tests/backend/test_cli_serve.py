"""``kvchat serve`` start-up checks that need no model: a busy port fails at once, in one line; a start that fails
after the server listens exits with one line too; JSON logs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.server import free_port
from support.server_process import REPO_ROOT


def _run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        cwd=REPO_ROOT,
        env=base | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def test_a_busy_port_fails_before_anything_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # NOTE: a model path that does not exist: reaching the model check would fail with another message.
        env = {"KVCHAT_DATA_DIR": str(tmp_path), "KVCHAT_PORT": str(port), "KVCHAT_MODEL": str(tmp_path / "none")}
        done, _ = _run(env, "serve")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: the port is already in use (another kvchat server?); "
        "set KVCHAT_PORT"
    )
    assert "Traceback" not in done.stderr


def test_a_start_that_fails_after_listening_exits_with_one_line(tmp_path: Path) -> None:
    # NOTE: a GGUF header passes the check made before listening; the conversion, part of the start, fails.
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    env = {
        "KVCHAT_DATA_DIR": str(tmp_path),
        "KVCHAT_MODEL": str(broken),
        "KVCHAT_CACHE_DIR": str(tmp_path / "cache"),
        "KVCHAT_PORT": str(free_port()),
    }
    done, _ = _run(env, "serve")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(
        "error: kvchat could not start: while converting model: cannot convert GGUF file 'broken.gguf': "
    ), lines[-5:]
    converting = "converting it to a safetensors cache, once (30 s or more on 2 cores)"
    assert any(line.endswith(converting) for line in lines)


def test_json_logs_are_one_object_a_line(tmp_path: Path) -> None:
    done, _ = _run({"KVCHAT_DATA_DIR": str(tmp_path), "KVCHAT_LOG_FORMAT": "json"}, "migrate")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.strip().splitlines()]
    assert records, "alembic logs its migrations"
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["logger"].startswith("alembic") for r in records)
