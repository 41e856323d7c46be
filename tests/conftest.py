"""Test-wide fixtures: the anyio backend, and PostgreSQL for the tests that need it.

Where Postgres comes from, in order: ``KVCHAT_TEST_DATABASE_URL``; the server at 127.0.0.1:5432; a throwaway cluster
started here with initdb/pg_ctl (as the ``postgres`` user when we are root). Under CI (``CI=true``) a test that needs
Postgres fails when none of these works — it never silently skips. Each test gets its own database, cloned from a
template that was migrated to head once per session.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from backend.db import migrate
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.testing import build_tiny_model

# NOTE: the default tenant of a fresh install gets the builtin handbook (backend/context/default_handbook.md); the
# tests that count a default-tenant prompt's tokens were written without one, so tests start it with none, and the
# handbook tests ask for it (``default_handbook="builtin"``). Set here so server subprocesses inherit it too.
os.environ.setdefault("KVCHAT_DEFAULT_HANDBOOK", "none")
# NOTE: the server's start collects the whole heap once before freezing it (backend/core/heap.py); in one test process
# that starts hundreds of apps, next to torch and every earlier test's objects, those collections dominated the run.
# tests/backend/core/test_heap.py covers the freeze itself, and a test that needs it on sets KVCHAT_GC_FREEZE=1.
os.environ.setdefault("KVCHAT_GC_FREEZE", "0")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), suppress_eos=True)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    """One engine for the whole session (its step loop runs in its own thread, independent of event loops)."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_kv_memory_mb=8, max_num_seqs=8)
    )
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@dataclass(frozen=True, slots=True)
class PgServer:
    """A reachable PostgreSQL server and the superuser DSN to administer it."""

    admin_dsn: str  # plain libpq-style DSN (postgresql://user@host:port/db)
    origin: str  # where it came from, for messages

    def url_for(self, database: str) -> str:
        return make_url(self.admin_dsn).set(database=database).render_as_string(hide_password=False)

    def async_url_for(self, database: str) -> str:
        return make_url(self.url_for(database)).set(drivername="postgresql+asyncpg").render_as_string(False)


async def _can_connect(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


async def _admin(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
    return str(candidates[0]) if candidates else None


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # NOTE: initdb and pg_ctl refuse to run as root.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


class ThrowawayCluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvchat-pg-"))
        self.port = _free_port()

    def start(self) -> str:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not initdb or not pg_ctl:
            raise RuntimeError("initdb/pg_ctl not found (install postgresql)")
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        subprocess.run(
            _as_postgres_user([initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
        )
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        subprocess.run(
            _as_postgres_user([pg_ctl, "-D", str(data), "-l", str(self.dir / "log"), "-o", opts, "-w", "start"]),
            check=True,
            capture_output=True,
        )
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        pg_ctl = _pg_bin("pg_ctl")
        if pg_ctl:
            subprocess.run(
                _as_postgres_user([pg_ctl, "-D", str(self.dir / "data"), "-m", "immediate", "stop"]),
                capture_output=True,
            )
        shutil.rmtree(self.dir, ignore_errors=True)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL is required under CI but unavailable: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable: {reason}")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    env_url = os.environ.get("KVCHAT_TEST_DATABASE_URL")
    if env_url:
        dsn = make_url(env_url).set(drivername="postgresql").render_as_string(hide_password=False)
        if not asyncio.run(_can_connect(dsn)):
            _unavailable(f"KVCHAT_TEST_DATABASE_URL={make_url(env_url)!s} does not answer")
        yield PgServer(dsn, "KVCHAT_TEST_DATABASE_URL")
        return
    local = "postgresql://postgres@127.0.0.1:5432/postgres"
    # KVCHAT_TEST_THROWAWAY_PG=1 skips the local server (to exercise the fresh-machine path).
    if not os.environ.get("KVCHAT_TEST_THROWAWAY_PG") and asyncio.run(_can_connect(local)):
        yield PgServer(local, "127.0.0.1:5432")
        return
    cluster = ThrowawayCluster()
    try:
        dsn = cluster.start()
    except (RuntimeError, subprocess.CalledProcessError, OSError, LookupError) as exc:
        cluster.stop()
        _unavailable(f"no server at 127.0.0.1:5432 and a throwaway cluster failed to start: {exc}")
        return
    try:
        yield PgServer(dsn, "throwaway cluster")
    finally:
        cluster.stop()


@pytest.fixture
def pg_empty_url(pg_server: PgServer) -> Iterator[str]:
    """An empty, freshly created database (asyncpg URL); dropped after the test."""
    name = f"kvchat_t_{secrets.token_hex(6)}"
    asyncio.run(_admin(pg_server.admin_dsn, f'CREATE DATABASE "{name}"'))
    try:
        yield pg_server.async_url_for(name)
    finally:
        asyncio.run(_admin(pg_server.admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_template(pg_server: PgServer) -> Iterator[str]:
    """A database migrated to head once per session; tests clone it."""
    name = f"kvchat_tpl_{secrets.token_hex(6)}"
    asyncio.run(_admin(pg_server.admin_dsn, f'CREATE DATABASE "{name}"'))
    try:
        migrate.upgrade(pg_server.async_url_for(name))
        yield name
    finally:
        asyncio.run(_admin(pg_server.admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def _clone_of_template(pg_server: PgServer, pg_template: str, prefix: str) -> Iterator[str]:
    """A new database cloned from the template (asyncpg URL); dropped afterwards."""
    name = f"{prefix}{secrets.token_hex(6)}"
    asyncio.run(_admin(pg_server.admin_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    try:
        yield pg_server.async_url_for(name)
    finally:
        asyncio.run(_admin(pg_server.admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url(pg_server: PgServer, pg_template: str) -> Iterator[str]:
    """A database at schema head, isolated to this test (asyncpg URL)."""
    with _clone_of_template(pg_server, pg_template, "kvchat_t_") as url:
        yield url


@pytest.fixture
def pg_other_url(pg_server: PgServer, pg_template: str) -> Iterator[str]:
    """A second database at schema head on the same server, e.g. for a neighbour kvchat server (asyncpg URL)."""
    with _clone_of_template(pg_server, pg_template, "kvchat_t_") as url:
        yield url


@pytest.fixture(scope="module")
def pg_module_url(pg_server: PgServer, pg_template: str) -> Iterator[str]:
    """A database at schema head shared by the tests of one module (for suites that need one server, not one each)."""
    with _clone_of_template(pg_server, pg_template, "kvchat_m_") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file at schema head, isolated to this test."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kvchat.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Run the test once on SQLite and once on Postgres, each on a database at head."""
    if request.param == "postgres":
        request.node.add_marker(pytest.mark.postgres)
        return str(request.getfixturevalue("pg_url"))
    return str(request.getfixturevalue("sqlite_url"))
