"""The backend's one settings object (env prefix ``KVCHAT_``)."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_SECRET = "dev-insecure-secret-change-me"


class Environment(StrEnum):
    DEVELOPMENT = "development"
    TEST = "test"
    PRODUCTION = "production"


class Settings(BaseSettings):
    """Every knob of the backend. See README.md (Configuration) for the table of env vars."""

    model_config = SettingsConfigDict(env_prefix="KVCHAT_", env_file=None, extra="ignore", frozen=True)

    env: Environment = Environment.DEVELOPMENT
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite file under data_dir
    secret_key: str = DEV_SECRET
    log_level: str = "info"
    run_migrations_on_start: bool = True
    # First start: the default tenant's keys. Unset → generated and printed once.
    bootstrap_chat_token: str | None = None
    bootstrap_admin_key: str | None = None

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> Self:
        # NOTE: a deployment that forgot to set its secret must fail loudly at start, not run with a public one.
        if self.env == Environment.PRODUCTION and self.secret_key == DEV_SECRET:
            raise ValueError("KVCHAT_SECRET_KEY must be set to a non-default value when KVCHAT_ENV=production")
        return self

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return f"sqlite+aiosqlite:///{(self.data_dir / 'kvchat.db').resolve()}"


def normalize_database_url(url: str) -> str:
    """Accept the usual spellings and pick the async driver (``postgres://`` → ``postgresql+asyncpg://``)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    if url.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + url[len("sqlite:///") :]
    return url
