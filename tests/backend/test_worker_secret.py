"""Workers on one database share one secret (issue 45): a second ``kvchat serve`` whose ``KVCHAT_SECRET_KEY`` differs
from the running one's refuses to start, in one line, before it serves anything; one with the same secret starts.
Real server processes on Postgres with the tiny model."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from backend.core.namespaces import secret_tag
from support.server_process import launch_server_process, start_server_process, tiny_server_env

pytestmark = pytest.mark.postgres


def test_a_second_worker_with_another_secret_refuses_to_start(
    pg_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    first_env = tiny_server_env(pg_url, tiny_model_dir, tmp_path / "a", secret_key="first-secret", log_level="info")
    first = start_server_process(first_env, tmp_path / "first.log")
    try:
        same = start_server_process(
            tiny_server_env(pg_url, tiny_model_dir, tmp_path / "b", secret_key="first-secret", log_level="info"),
            tmp_path / "same.log",
        )
        assert same.terminate() in (0, -signal.SIGTERM)
        other_env = tiny_server_env(pg_url, tiny_model_dir, tmp_path / "c", secret_key="other-secret")
        other = launch_server_process(other_env, tmp_path / "other.log")
        try:
            code = other.proc.wait(120)
        except subprocess.TimeoutExpired:
            other.kill()
            raise
        assert first.phase() == "ready"  # the first one serves on
    finally:
        first.terminate()
    lines = other.log().strip().splitlines()
    assert code == 1, lines[-5:]
    assert "Traceback" not in other.log()
    assert re.match(r"error: kvchat could not start: while \w+: another kvchat worker on this database \(", lines[-1])
    assert lines[-1].endswith(
        f":{secret_tag(b'first-secret')}) uses another KVCHAT_SECRET_KEY: every worker on one database must share it "
        "(the cache namespaces derive from it); set the same KVCHAT_SECRET_KEY here"
    )
