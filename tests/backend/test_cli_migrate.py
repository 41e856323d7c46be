"""``kvchat migrate`` on a fresh checkout (no data dir yet) and against a database that is not there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _migrate(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", "migrate"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | env,
    )


def test_migrate_creates_the_data_dir_of_a_fresh_checkout(tmp_path: Path) -> None:
    data = tmp_path / "not" / "there" / "yet"
    result = _migrate({"KVCHAT_DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr
    assert (data / "kvchat.db").is_file()
    assert "migrations done" in result.stdout


def test_migrate_against_an_unreachable_database_is_one_clear_line(tmp_path: Path) -> None:
    result = _migrate({"KVCHAT_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nothing"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot migrate postgresql+asyncpg://nobody@127.0.0.1:1/nothing: ")
