"""``kvchat tenants`` and ``kvchat keys`` as an operator runs them: real subprocesses on a migrated SQLite file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.server_process import REPO_ROOT


def _kvchat(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")} | {"KVCHAT_DATA_DIR": str(data_dir)}
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    assert _kvchat(tmp_path, "migrate").returncode == 0
    return tmp_path


def test_create_a_tenant_list_it_and_manage_its_keys(data_dir: Path) -> None:
    created = _kvchat(data_dir, "tenants", "create", "acme", "--system-prompt", "You help Acme customers.")
    assert created.returncode == 0, created.stderr
    chat = re.search(r"chat token \(also an OpenAI API key\): (kvc_chat_\S+)", created.stdout)
    admin = re.search(r"admin API key: (kvc_admin_\S+)", created.stdout)
    assert chat and admin
    listed = _kvchat(data_dir, "tenants", "list")
    assert "acme" in listed.stdout and "default" not in listed.stdout  # the server's bootstrap has not run here
    issued = _kvchat(data_dir, "keys", "create", "--tenant", "acme", "--kind", "chat")
    key_id = re.search(r"chat key (\S+) for tenant acme: kvc_chat_", issued.stdout)
    assert issued.returncode == 0 and key_id, issued.stdout
    keys = _kvchat(data_dir, "keys", "list", "--tenant", "acme").stdout
    assert keys.count(" chat ") == 2 and keys.count(" admin ") == 1
    assert chat.group(1) not in keys  # prefixes only, never the key
    revoked = _kvchat(data_dir, "keys", "revoke", key_id.group(1))
    assert revoked.returncode == 0 and "revoked chat key" in revoked.stdout
    after = [
        line
        for line in _kvchat(data_dir, "keys", "list", "--tenant", "acme").stdout.splitlines()
        if key_id.group(1) in line
    ]
    assert len(after) == 1 and not after[0].endswith(" -")
    again = _kvchat(data_dir, "keys", "revoke", key_id.group(1))
    assert again.returncode == 1
    assert re.fullmatch(
        rf"error: key '{key_id.group(1)}' was already revoked \(\d{{4}}-\d\d-\d\d \d\d:\d\d UTC\)\n", again.stderr
    ), again.stderr
    assert again.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("keys", "create", "--tenant", "nope", "--kind", "chat"), "error: no tenant 'nope'"),
        (("keys", "revoke", "no-such-key"), "error: no key 'no-such-key'"),
    ],
)
def test_mistakes_get_one_clear_line(data_dir: Path, args: tuple[str, ...], message: str) -> None:
    done = _kvchat(data_dir, *args)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [message]


def test_a_duplicate_tenant_is_refused(data_dir: Path) -> None:
    assert _kvchat(data_dir, "tenants", "create", "acme").returncode == 0
    again = _kvchat(data_dir, "tenants", "create", "acme")
    assert again.returncode == 1
    assert again.stderr.strip() == "error: a tenant named 'acme' already exists"


def test_an_unmigrated_database_says_what_to_do(tmp_path: Path) -> None:
    done = _kvchat(tmp_path, "tenants", "list")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: the database failed:")
    assert "kvchat migrate" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_add_an_agent_rotate_their_key_and_revoke_it(data_dir: Path) -> None:
    assert _kvchat(data_dir, "tenants", "create", "acme").returncode == 0
    created = _kvchat(data_dir, "agents", "create", "--tenant", "acme", "Dana")
    assert created.returncode == 0, created.stderr
    first = re.search(r"agent key (\S+): (kvc_agent_\S+)", created.stdout)
    assert first and created.stdout.startswith("agent Dana (")
    twice = _kvchat(data_dir, "agents", "create", "--tenant", "acme", "Dana")
    assert (twice.returncode, twice.stderr) == (1, "error: an agent named 'Dana' already exists\n")
    assert " Dana " in _kvchat(data_dir, "agents", "list", "--tenant", "acme").stdout
    rotated = _kvchat(data_dir, "agents", "rotate", "--tenant", "acme", "Dana")
    second = re.search(r"agent key (\S+): (kvc_agent_\S+) \(1 older key\(s\) revoked\)", rotated.stdout)
    assert rotated.returncode == 0 and second, rotated.stdout
    keys = _kvchat(data_dir, "keys", "list", "--tenant", "acme").stdout.splitlines()
    [old] = [line for line in keys if first.group(1) in line]
    [new] = [line for line in keys if second.group(1) in line]
    assert " agent " in old and not old.endswith(" -")  # revoked by the rotation
    assert new.endswith(" -")
    assert _kvchat(data_dir, "keys", "revoke", second.group(1)).returncode == 0
    by_kind = _kvchat(data_dir, "keys", "create", "--tenant", "acme", "--kind", "agent")
    assert by_kind.returncode == 2  # (argparse: agents get their keys from `kvchat agents`)
