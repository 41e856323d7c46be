"""Run Alembic migrations from code (``kvchat migrate``, the app's start-up, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from backend.db.engine import check_database_url, ensure_sqlite_dir

REPO_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str) -> Config:
    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    cfg.attributes["url"] = url
    cfg.attributes["skip_logging_config"] = True
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url``. Blocking (Alembic's env runs its own event loop): call via a thread.

    Raises ``UnsupportedDatabaseError`` for a URL kvchat does not run on (before any driver is imported).
    """
    check_database_url(url)
    ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
