"""The ``kvchat`` entry points on a fresh checkout and when they cannot start: one ``error:`` line, non-zero exit.

Each test runs the real CLI in a subprocess: ``migrate``, ``serve``, ``generate`` and ``chat``, against a database
that is not there, a URL kvchat does not support, a model that is not there, a server that does not answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.server_process import free_port

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/nothing"


def _kvchat(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=os.environ | (env or {}),
        stdin=subprocess.DEVNULL,
    )


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The whole stderr: exactly one line, starting ``error: ``; returns it."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_migrate_creates_the_data_dir_of_a_fresh_checkout(tmp_path: Path) -> None:
    data = tmp_path / "not" / "there" / "yet"
    result = _kvchat("migrate", env={"KVCHAT_DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr
    assert (data / "kvchat.db").is_file()
    assert "migrations done" in result.stdout


def test_migrate_against_an_unreachable_database_is_one_clear_line() -> None:
    result = _kvchat("migrate", env={"KVCHAT_DATABASE_URL": UNREACHABLE})
    assert result.returncode == 1
    line = _one_error_line(result)
    assert line.startswith("error: cannot migrate postgresql+asyncpg://nobody@127.0.0.1:1/nothing: ")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mysql://u:secret@db.example/shop", "error: unsupported database 'mysql': use postgresql://"),
        ("foo", "error: 'foo' is not a database URL (e.g. postgresql://host/db)"),
    ],
)
@pytest.mark.parametrize("command", ["migrate", "serve"])
def test_an_unsupported_database_url_is_one_line(command: str, url: str, expected: str) -> None:
    result = _kvchat(command, env={"KVCHAT_DATABASE_URL": url})
    assert result.returncode == 1
    assert _one_error_line(result).startswith(expected)
    assert "secret" not in result.stderr + result.stdout


def test_serve_against_an_unreachable_database_is_one_line() -> None:
    result = _kvchat("serve", "--port", str(free_port()), env={"KVCHAT_DATABASE_URL": UNREACHABLE})
    assert result.returncode == 1
    line = _one_error_line(result)
    assert line.startswith("error: cannot reach the database postgresql+asyncpg://nobody@127.0.0.1:1/nothing: ")


def test_serve_with_a_missing_model_is_one_line(tmp_path: Path) -> None:
    env = {"KVCHAT_DATA_DIR": str(tmp_path), "KVCHAT_MODEL": str(tmp_path / "no-model")}
    result = _kvchat("serve", "--port", str(free_port()), env=env)
    assert result.returncode == 1
    assert _one_error_line(result) == (
        f"error: cannot load the model '{tmp_path / 'no-model'}': model path '{tmp_path / 'no-model'}' does not exist"
    )


def test_serve_with_an_invalid_setting_is_one_line(tmp_path: Path) -> None:
    result = _kvchat("serve", env={"KVCHAT_DATA_DIR": str(tmp_path), "KVCHAT_SHUTDOWN_GRACE_SECONDS": "-1"})
    assert result.returncode == 1
    assert _one_error_line(result) == (
        "error: invalid setting shutdown_grace_seconds: Input should be greater than or equal to 0"
    )


def test_generate_with_a_missing_model_is_one_line(tmp_path: Path) -> None:
    result = _kvchat("generate", "hello", "--model", str(tmp_path / "nothing.gguf"))
    assert result.returncode == 2
    assert _one_error_line(result) == f"error: model path '{tmp_path / 'nothing.gguf'}' does not exist"


def test_chat_against_a_server_that_is_not_there_is_one_line() -> None:
    port = free_port()
    result = _kvchat("chat", "--url", f"ws://127.0.0.1:{port}/ws/chat", "--token", "t")
    assert result.returncode == 1
    assert _one_error_line(result).startswith(f"error: cannot connect to ws://127.0.0.1:{port}/ws/chat: ")
